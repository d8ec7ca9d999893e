// nsqjs 0.13.0 scenarios for tests/compat (see compat_util.py for the shapes).
//
//   echo '<json params>' | node scenarios.js
//
// Prints progress events as JSON lines and finally {"result": {...}}
// (or {"result": {"error": "..."}}).
//
// Library facts these scenarios rely on (read from nsqjs' source):
// - Writer.publish(topic, msgs, cb) sends PUB for one message and MPUB for an
//   array of several; cb(err) is called with null on OK. deferPublish sends DPUB.
//   A Writer never reconnects: after 'closed'/'error' a new one must be made.
// - A Reader with nsqdTCPAddresses re-dials a lost nsqd every
//   lookupdPollInterval seconds.
// - heartbeatInterval is in seconds, messageTimeout in ms; TLS takes `ca` as a
//   Buffer; snappy needs the optional `snappystream` package.
// - heartbeats are answered internally with no event: we count the NOPs the
//   connection builds (wire.nop).
'use strict'

const fs = require('fs')
const nsq = require('nsqjs')
const wire = require('nsqjs/lib/wire')

let nops = 0
const origNop = wire.nop
wire.nop = (...args) => {
  nops += 1
  return origNop(...args)
}

// IDENTIFY responses of every connection that became ready (what was negotiated).
const identified = []
const origEmit = nsq.NSQDConnection.prototype.emit
nsq.NSQDConnection.prototype.emit = function (event, ...args) {
  if (event === nsq.NSQDConnection.READY && this.statemachine) {
    identified.push(this.statemachine.identifyResponse)
  }
  return origEmit.call(this, event, ...args)
}

const T0 = process.hrtime.bigint()
const now = () => Number(process.hrtime.bigint() - T0) / 1e9
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms))
const emit = (obj) => process.stdout.write(JSON.stringify(obj) + '\n')

async function until(cond, timeoutS, what) {
  const deadline = now() + timeoutS
  while (!cond()) {
    if (now() > deadline) throw new Error(`timed out waiting for ${what}`)
    await sleep(20)
  }
}

function withTimeout(promise, ms, what) {
  let timer
  return Promise.race([
    promise,
    new Promise((resolve, reject) => {
      timer = setTimeout(() => reject(new Error(`timeout: ${what}`)), ms)
    }),
  ]).finally(() => clearTimeout(timer))
}

function connOptions(opts) {
  opts = opts || {}
  const o = {}
  if (opts.tls) {
    o.tls = true
    o.tlsVerification = true
    o.ca = fs.readFileSync(opts.tls.ca)
  }
  if (opts.snappy) o.snappy = true
  if (opts.deflate) o.deflate = true
  if (opts.auth_secret) o.authSecret = opts.auth_secret
  if (opts.msg_timeout_ms) o.messageTimeout = opts.msg_timeout_ms
  if (opts.heartbeat_ms) o.heartbeatInterval = opts.heartbeat_ms / 1000
  return o
}

class Ctx {
  constructor(p) {
    this.p = p
    this.clients = []
    const [host, port] = p.tcp.split(':')
    this.host = host
    this.port = Number(port)
  }

  // A connected Writer (rejects with the connection's error, e.g. E_AUTH_FAILED).
  writer(opts) {
    const w = new nsq.Writer(this.host, this.port,
      connOptions(opts === undefined ? this.p.conn : opts))
    this.clients.push(w)
    w.errors = []
    w.on('error', (err) => w.errors.push(String(err && err.message || err)))
    return new Promise((resolve, reject) => {
      w.on('ready', () => resolve(w))
      w.on('error', reject)
      w.on('closed', () => reject(new Error('closed: ' + w.errors.join('; '))))
      w.connect()
    })
  }

  reader(channel, onMessage, opts, extra) {
    const r = new nsq.Reader(this.p.topic, channel, Object.assign({
      nsqdTCPAddresses: [this.p.tcp],
      lookupdPollInterval: 1,
    }, connOptions(opts === undefined ? this.p.conn : opts), extra || {}))
    this.clients.push(r)
    r.connects = 0
    r.errors = []
    r.on('nsqd_connected', () => { r.connects += 1 })
    r.on('error', (err) => r.errors.push(String(err && err.message || err)))
    r.on('message', onMessage)
    r.connect()
    return r
  }

  close() {
    for (const c of this.clients) {
      try { c.close() } catch (e) { /* already closed */ }
    }
  }
}

function publish(w, topic, msgs) {
  return new Promise((resolve, reject) => {
    w.publish(topic, msgs, (err) => (err ? reject(err) : resolve('OK')))
  })
}

function deferPublish(w, topic, msg, ms) {
  // deferPublish passes `msg` to the connection as is, which wants an array
  // of one message (a bare Buffer throws "Expect an array of messages").
  return new Promise((resolve, reject) => {
    w.deferPublish(topic, [msg], ms, (err) => (err ? reject(err) : resolve('OK')))
  })
}

const str = (buf) => buf.toString('utf8')

async function subscribed(r) {
  await until(() => r.connects > 0, 5, 'reader connection')
  await sleep(150) // SUB and RDY are on the wire
}

// ---- scenarios ------------------------------------------------------------------

async function pubsub(ctx) {
  const p = ctx.p
  const w = await ctx.writer()
  const acks = []
  if (p.mode === 'mpub') {
    acks.push(await publish(w, p.topic, p.bodies.map((b) => Buffer.from(b))))
  } else {
    for (const b of p.bodies) acks.push(await publish(w, p.topic, Buffer.from(b)))
  }
  const received = []
  ctx.reader(p.channel, (m) => {
    received.push([str(m.body), m.attempts])
    m.finish()
  }, undefined, {maxInFlight: 10})
  await until(() => received.length >= p.bodies.length, 15, 'all messages')
  await sleep(300)
  return {acks, received: received.slice(), identify: identified.slice()}
}

async function dpub(ctx) {
  const p = ctx.p
  const received = []
  const r = ctx.reader(p.channel, (m) => {
    received.push([str(m.body), m.attempts, now()])
    m.finish()
  }, undefined, {maxInFlight: 10})
  const w = await ctx.writer()
  await subscribed(r)
  const tSend = now()
  const ackLater = await deferPublish(w, p.topic, Buffer.from('later'), p.defer_ms)
  const ackNow = await publish(w, p.topic, Buffer.from('now'))
  await until(() => received.length >= 2, p.defer_ms / 1000 + 5, 'deferred message')
  await sleep(300)
  return {acks: [ackLater, ackNow], t_send: tSend, received}
}

async function req(ctx) {
  const p = ctx.p
  const received = []
  const w = await ctx.writer()
  await publish(w, p.topic, Buffer.from('again'))
  ctx.reader(p.channel, (m) => {
    received.push([str(m.body), m.attempts, now()])
    if (m.attempts === 1) m.requeue(p.req_ms, false)
    else m.finish()
  })
  await until(() => received.length >= 2, 10, 'redelivery after REQ')
  await sleep(500)
  return {received}
}

async function touch(ctx) {
  const p = ctx.p
  const received = []
  const state = {}
  const w = await ctx.writer()
  await publish(w, p.topic, Buffer.from('touched'))
  ctx.reader(p.channel, (m) => {
    received.push([str(m.body), m.attempts, now()])
    if (m.attempts > 1) return m.finish()
    const end = now() + p.hold_ms / 1000
    const timer = setInterval(() => {
      m.touch()
      if (now() >= end) {
        clearInterval(timer)
        m.finish()
        state.fin_t = now()
      }
    }, p.touch_every_ms)
  })
  await until(() => 'fin_t' in state, p.hold_ms / 1000 + 5, 'FIN after touching')
  await sleep(p.linger_ms)
  return {received, fin_t: state.fin_t}
}

async function timeout(ctx) {
  const p = ctx.p
  const received = []
  const w = await ctx.writer()
  await publish(w, p.topic, Buffer.from('slow'))
  ctx.reader(p.channel, (m) => {
    received.push([str(m.body), m.attempts, now()])
    if (m.attempts > 1) m.finish() // the first delivery is never answered
  })
  await until(() => received.length >= 2, 10, 'redelivery after timeout')
  await sleep(300)
  return {received}
}

async function multiConsumer(ctx) {
  const p = ctx.p
  const got = [[], []]
  const readers = [0, 1].map((i) => ctx.reader(p.channel, (m) => {
    got[i].push(str(m.body))
    setTimeout(() => m.finish(), 5)
  }, undefined, {maxInFlight: 2}))
  const w = await ctx.writer()
  for (const r of readers) await subscribed(r)
  for (const b of p.bodies) await publish(w, p.topic, Buffer.from(b))
  await until(() => got[0].length + got[1].length >= p.bodies.length, 15, 'all messages')
  await sleep(500)
  return {consumers: got}
}

async function multiChannel(ctx) {
  const p = ctx.p
  const got = {}
  const readers = p.channels.map((c) => {
    got[c] = []
    return ctx.reader(c, (m) => {
      got[c].push(str(m.body))
      m.finish()
    }, undefined, {maxInFlight: 10})
  })
  const w = await ctx.writer()
  for (const r of readers) await subscribed(r)
  await publish(w, p.topic, p.bodies.map((b) => Buffer.from(b)))
  await until(() => Object.values(got).every((v) => v.length >= p.bodies.length), 15,
    "every channel's copy")
  await sleep(300)
  return {channels: got}
}

async function heartbeat(ctx) {
  const p = ctx.p
  const received = []
  const r = ctx.reader(p.channel, (m) => {
    received.push([str(m.body), m.attempts])
    m.finish()
  })
  await subscribed(r)
  const before = nops
  await sleep(p.idle_s * 1000)
  const heartbeats = nops - before
  const connectsBefore = r.connects
  const w = await ctx.writer({})
  await publish(w, p.topic, Buffer.from('after-idle'))
  await until(() => received.length > 0, 5, 'message after the idle period')
  return {heartbeats, connects: r.connects, connects_before_pub: connectsBefore, received,
    errors: r.errors}
}

async function auth(ctx) {
  const p = ctx.p
  const result = await pubsub(ctx)
  let bad = []
  try {
    await ctx.writer(Object.assign({}, p.conn, {auth_secret: p.bad_secret}))
    bad = ['no error: the bad secret was accepted']
  } catch (err) {
    bad = [String(err && err.message || err)]
  }
  result.bad_secret_errors = bad
  const po = Object.assign({}, p.conn, {auth_secret: p.pub_only_secret})
  const w = await ctx.writer(po)
  result.pub_only_ack = await publish(w, p.topic + '_po', Buffer.from('by-publisher'))
  const r = ctx.reader(p.channel, (m) => m.finish(), po)
  await until(() => r.errors.length > 0, 5, 'SUB refused')
  result.pub_only_sub_errors = r.errors
  return result
}

async function reconnect(ctx) {
  const p = ctx.p
  const received = []
  const acked = []
  ctx.reader(p.channel, (m) => {
    received.push(str(m.body))
    // a slow consumer, so acked messages wait in the queue at the crash
    setTimeout(() => m.finish(), p.consume_delay_ms)
  }, undefined, {maxInFlight: 5})
  let w = null
  let errors = 0
  const deadline = now() + (p.wait || 40)
  for (let i = 0; i < p.n; i++) {
    const body = `r-${i}`
    for (;;) {
      if (now() > deadline) throw new Error(`could not publish ${body}`)
      try {
        if (w === null) w = await withTimeout(ctx.writer(), 5000, 'writer connect')
        await withTimeout(publish(w, p.topic, Buffer.from(body)), 5000, 'PUB ack')
        break
      } catch (err) {
        errors += 1
        // nsqjs Writers do not reconnect: make a new one.
        if (w !== null) {
          try { w.close() } catch (e) { /* gone */ }
          w = null
        }
        await sleep(100)
      }
    }
    acked.push(body)
    emit({event: 'progress', acked: acked.length, received: received.length})
  }
  const receivedSet = () => new Set(received)
  await until(() => { const s = receivedSet(); return acked.every((b) => s.has(b)) },
    p.wait || 40, 'every acked message')
  await sleep(300)
  return {acked, received, publish_errors: errors}
}

const SCENARIOS = {
  pubsub, dpub, req, touch, timeout, multi_consumer: multiConsumer,
  multi_channel: multiChannel, heartbeat, auth, reconnect,
}

async function main() {
  const chunks = []
  for await (const chunk of process.stdin) chunks.push(chunk)
  const params = JSON.parse(Buffer.concat(chunks).toString('utf8'))
  const ctx = new Ctx(params)
  let result
  try {
    result = await SCENARIOS[params.scenario](ctx)
  } catch (err) {
    result = {error: String(err && err.stack || err)}
  }
  ctx.close()
  process.stdout.write(JSON.stringify({result}) + '\n', () => process.exit(0))
}

main()
