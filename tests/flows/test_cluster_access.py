"""A cluster of the user's, spoken to over TLS.

Both clusters are real: ``dask scheduler`` and two ``dask worker`` processes on
127.0.0.1, started as docs/runtime.md says (tests/flows/dask_cluster.py).

- Over TLS, with a CA and a certificate made in the test (tests/flows/tls_certs.py):
  a run given the certificates (``runtime.tls``) finishes with the node files of a run
  that never left one process; a plain ``tcp://`` client, and a client holding a
  certificate another CA signed, cannot connect; a run without certificates is refused
  before it starts. (A plain ``tcp://`` address on another machine is refused when the
  config is read: tests/core/test_config.py.)
"""

import pytest
from distributed import Client

from flows.records.run_record import RunRecord
from tests.flows.commands import own_servers_env, sets
from tests.flows.dask_cluster import user_cluster
from tests.flows.kill_chain import cli, leftovers, node_files, uninterrupted
from tests.flows.tls_certs import make_certificates

pytestmark = pytest.mark.integration


def _env() -> dict[str, str]:
    return own_servers_env(HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def _refused(address: str, **kwargs) -> str:
    """The error of a client that tries ``address`` (what an outsider gets); fails if it connects."""
    try:
        with Client(address, set_as_default=False, timeout="5s", **kwargs):
            pass
    except (OSError, TimeoutError) as exc:
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError(f"a client connected to {address} with {kwargs or 'no certificate'}")


def test_a_tls_cluster_runs_an_experiment_and_refuses_clients_without_its_certificates(tmp_path):
    certs = make_certificates(tmp_path / "tls")
    stranger = make_certificates(tmp_path / "stranger", ca_name="someone else's CA")
    reference = uninterrupted(tmp_path / "reference")
    with user_cluster(tmp_path, _env(), tls=certs) as (address, _):
        assert address.startswith("tls://127.0.0.1:"), address
        _refused(address.replace("tls://", "tcp://"))  # plain TCP to the TLS port: the handshake fails
        _refused(address, security=stranger.security())  # a certificate the cluster's CA did not sign
        cluster = ("runtime.executor=cluster", f"runtime.cluster={address}", "runtime.workers=auto")

        no_certificates, _ = cli("run", *sets(*cluster), faults=None, run_dir=tmp_path / "refused")
        assert no_certificates.returncode == 2, no_certificates.stderr[-3000:]
        error = " ".join(no_certificates.stderr.split())
        assert f"error: runtime.cluster is {address} but no certificate is set: give runtime.tls" in error, error
        assert not list((tmp_path / "refused").glob("itest/*/run.json"))  # refused before anything started

        run_dir = tmp_path / "runs"
        done, session = cli("run", *sets(*cluster, certs.config_value()), faults=None, run_dir=run_dir)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "2 worker(s): w0 (cpu), w1 (cpu)" in done.stderr
        assert leftovers(session) == []
    (run_path,) = (run_dir / "itest").iterdir()
    assert RunRecord.read(run_path).cluster == address
    assert node_files(run_path) == reference
    assert str(certs.key_file) not in (run_path / "run.json").read_text()  # (only the config names the files)
