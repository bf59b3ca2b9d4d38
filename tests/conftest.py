"""The one vLLM server the self-consistency route tests share (the embedded
model, consensus drafting, the endpoint plugin through VLLM_PLUGINS):
started once, on first use, and always stopped."""

import os
import shutil
import tempfile

import pytest

# never the user's cache: engines started at collection or by session fixtures remember step
# costs here; each test's own get a folder of their own (_own_step_costs below)
_STEP_COSTS = tempfile.mkdtemp(prefix="consensus_spec_step_costs_")
os.environ["CONSENSUS_SPEC_STEP_COSTS_DIR"] = _STEP_COSTS


def pytest_unconfigure(config):
    shutil.rmtree(_STEP_COSTS, ignore_errors=True)


@pytest.fixture(autouse=True)
def _own_step_costs(monkeypatch, tmp_path_factory):
    """Each test's engines (and the processes it starts) remember step costs in a folder of
    its own: a proposer saves what it learned when it goes, and a table one test's tiny
    engine learned must not set how much the next test's engine drafts."""
    monkeypatch.setenv("CONSENSUS_SPEC_STEP_COSTS_DIR", str(tmp_path_factory.mktemp("step_costs")))

SC_MAX_INFLIGHT = 6  # CONSENSUS_SPEC_SC_MAX_INFLIGHT for this server
SC_MAX_N = 32


@pytest.fixture(scope="session")
def sc_server(tmp_path_factory):
    from tests import sc_soak, server_soak

    log_dir = tmp_path_factory.mktemp("sc_server")
    srv = sc_soak.start_server(log_dir, env={"CONSENSUS_SPEC_SC_MAX_INFLIGHT": str(SC_MAX_INFLIGHT),
                                             "CONSENSUS_SPEC_SC_MAX_N": str(SC_MAX_N)})
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()
        assert server_soak.process_group(srv.proc.pid) == [], "server left processes behind"
