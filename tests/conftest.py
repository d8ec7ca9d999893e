import os
import shutil

import pytest


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true", default=False,
                     help="run the long fault runs (thousands of kills)")


def pytest_report_header(config):
    """The free disk where the tests write (a CI run once failed on a full disk), and
    whether the hot path runs compiled (scripts/compile.py) or pure (NSQ_PURE=1)."""
    import tempfile

    import nsqwire.protocol
    where = config.option.basetemp or tempfile.gettempdir()
    while not os.path.exists(where):
        where = os.path.dirname(where)
    free = shutil.disk_usage(where).free
    compiled = nsqwire.protocol.__file__.endswith(".so")
    return [f"free disk under {where}: {free / 2**30:.1f} GiB (the suite's peak is about 0.9 GiB)",
            f"hot path: {'compiled (build/mypyc)' if compiled else 'pure .py modules'}"]


def pytest_collection_modifyitems(config, items):
    if config.getoption("--long"):
        for item in items:
            if "long" in item.keywords:
                item.add_marker(pytest.mark.timeout(0))  # an hour of faults is the point
        return
    skip = pytest.mark.skip(reason="long run: pass --long")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def nsqd(tmp_path):
    """A running nsqd subprocess with a temporary data path; stopped after the test."""
    from servers import NsqdProcess

    proc = NsqdProcess(str(tmp_path / "nsqd")).start()
    yield proc
    proc.kill()


@pytest.fixture
async def node(tmp_path):
    """Start in-process nsqd nodes: `await node(clock=None, **options)`; stopped after."""
    from nsqd.main import build
    from nsqd.options import Options

    started = []

    async def start(clock=None, **kw):
        n = build(Options(tcp_address="127.0.0.1:0", http_address="127.0.0.1:0",
                          data_path=str(tmp_path / "data"), log_level="warning", **kw))
        if clock is not None:
            n.clock = clock
        await n.start()
        started.append(n)
        return n

    yield start
    for n in started:
        await n.stop()


@pytest.fixture
def etcd_server(tmp_path):
    """A real etcd on free loopback ports with its own data dir; SIGKILLed after the test."""
    from etcdserver import EtcdProcess

    proc = EtcdProcess(str(tmp_path / "etcd")).start()
    yield proc
    proc.kill()


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory, request):
    """A folder for a module's shared servers; removed after the module when none of its
    tests failed (as a passed test's tmp_path is: pyproject's tmp_path_retention_policy),
    so the suite's disk use stays near one test's."""
    failed = request.session.testsfailed
    path = tmp_path_factory.mktemp(request.module.__name__.removeprefix("test_"))
    yield path
    if request.session.testsfailed == failed:
        shutil.rmtree(path, ignore_errors=True)
