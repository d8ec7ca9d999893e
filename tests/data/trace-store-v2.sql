-- A trace store of version 2, as trace/store.py of commit 985e9d3 made it from
-- trace-store-v1.sql: applied on top of that file, this is what its conversion did (a
-- span per topic, the (topic, time_ns) index dropped). tests/test_trace.py converts it
-- with the current store.
BEGIN TRANSACTION;
CREATE TABLE topic_spans (
    topic TEXT NOT NULL,
    first_id INTEGER NOT NULL,
    last_id INTEGER NOT NULL,
    min_time INTEGER NOT NULL,
    max_time INTEGER NOT NULL
);
INSERT INTO "topic_spans" VALUES('audit',4,36,1764000000000001000,1764000000000011800);
INSERT INTO "topic_spans" VALUES('orders',1,33,1764000000000000000,1764000000000010800);
CREATE INDEX topic_spans_topic ON topic_spans (topic, max_time);
DROP INDEX events_topic_time;
COMMIT;
PRAGMA user_version = 2;
