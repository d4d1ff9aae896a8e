"""A cluster of the user's: spoken to over TLS, and checked to see the run folder before anything trains.

Both clusters are real: ``dask scheduler`` and two ``dask worker`` processes on
127.0.0.1, started as docs/runtime.md says (tests/flows/dask_cluster.py).

- Over TLS, with a CA and a certificate made in the test (tests/flows/tls_certs.py):
  a run given the certificates (``runtime.tls``) finishes with the node files of a run
  that never left one process; a plain ``tcp://`` client, and a client holding a
  certificate another CA signed, cannot connect; a run without certificates is refused
  before it starts. (A plain ``tcp://`` address on another machine is refused when the
  config is read: tests/core/test_config.py.)
- A worker that sees another folder where the run folder should be (the usual mistake:
  a local disk on a machine where the shared one is not mounted; here a tmpfs mounted
  over the run directory in the worker's own mount namespace) is named before any
  training, with the fix; the command exits 2.
"""

import os

import pytest
from distributed import Client

from flows.records.run_record import RunRecord
from tests.flows.commands import own_servers_env, sets
from tests.flows.dask_cluster import user_cluster
from tests.flows.kill_chain import cli, leftovers, node_files, uninterrupted
from tests.flows.tls_certs import make_certificates
from tests.mount_namespace import NO_NAMESPACE, namespace_prefix, tmpfs_mount

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


def test_a_worker_that_does_not_see_the_run_folder_is_named_before_training(tmp_path):
    run_dir = tmp_path / "runs"
    run_dir.mkdir()
    prefix = namespace_prefix(tmp_path)
    if prefix is None:
        pytest.skip(NO_NAMESPACE + "no worker with a view of the filesystem of its own")
    # w1 sees an empty tmpfs where the run directory is: the run folder, the data cache are not there
    elsewhere = [*prefix, "sh", "-c", f'{tmpfs_mount("1m")} && shift && exec "$@"', "sh", str(run_dir)]
    with user_cluster(tmp_path, _env(), wrap={"w1": elsewhere}) as (address, _):
        cluster = ("runtime.executor=cluster", f"runtime.cluster={address}", "runtime.workers=auto")
        failed, session = cli("run", *sets(*cluster), faults=None, run_dir=run_dir)
        with Client(address, set_as_default=False) as client:
            names = {str(w["name"]): a for a, w in client.scheduler_info()["workers"].items()}
    assert failed.returncode == 2, failed.stderr[-3000:]
    err = " ".join(failed.stderr.split())
    (run_path,) = (run_dir / "itest").iterdir()
    assert f"error: worker w1 ({names['w1']}) does not see the run folder: it cannot read {run_path}/" in err, err
    assert "worker w0" not in err and "Traceback" not in err, err
    assert f"mount the run directory {run_dir} (NFS, Lustre, a bind mount) at {run_dir} on every worker" in err
    assert f"continue with `bhfl resume {run_path}`" in err
    assert leftovers(session) == []
    assert not (run_path / "state" / "nodes").exists() or not os.listdir(run_path / "state" / "nodes")  # untrained
    assert not [p for p in run_path.iterdir() if p.name.startswith(".shared-folder-probe")]  # the probe removed
