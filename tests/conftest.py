import pytest


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true", default=False,
                     help="run the long fault runs (thousands of kills)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--long"):
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
