"""Config validation: unknown keys, wrong types and impossible trees name the key."""

import re
from pathlib import Path

import pytest

from bhfl_core.config.base import ConfigError
from bhfl_core.config.loader import apply_override, config_from_dict, load_config
from bhfl_core.config.topology import ClientInfo, build_tree

REPO = Path(__file__).resolve().parents[2]


def test_embedded_default_is_valid_and_matches_the_issue_shape():
    cfg = load_config(REPO / "configs" / "embedded.yaml")
    clients = [ClientInfo(f"{lang}-{i}", lang, 10) for lang in cfg.data.source.languages for i in range(6)]
    tree = build_tree(cfg, clients)
    assert tree.root.settings.train is not None  # proxy training at the root
    assert sorted(tree.root.children) == ["europe-east", "europe-west"]
    edges = [n for n in tree if n.role.value == "edge"]
    assert sorted(e.id for e in edges) == [f"edge-{lang}" for lang in sorted(cfg.data.source.languages)]
    assert all(e.settings.cohort and e.settings.cohort < len(e.children) for e in edges)
    assert tree.distance("en-0", "de-0") == 6 and tree.distance("en-0", "edge-en") == 1


def test_the_readme_main_job_runs_the_config_the_readme_recommends():
    """``bash scripts/run-default.sh`` (the README's first command) runs the config its 3-seed table puts in bold."""
    script = (REPO / "scripts" / "run-default.sh").read_text()
    runs = re.findall(r'^exec \.venv/bin/bhfl run (\S+) "\$@"$', script, flags=re.MULTILINE)
    readme = (REPO / "README.md").read_text()
    recommended = re.findall(r"^\| \*\*`([\w.-]+\.yaml)`\*\* \|", readme, flags=re.MULTILINE)  # the winning row
    assert runs == ["configs/bhfl.yaml"] and recommended == ["bhfl.yaml"]
    assert "bash scripts/run-default.sh   # B-HFL, configs/bhfl.yaml" in readme  # and "Two commands" says so
    cfg = load_config(REPO / runs[0])
    assert cfg.name == "bhfl" and cfg.tree.edge.eta_down == 0.3  # partial aggregation down at the edges


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["tree.root.roundz=2"], "tree.root.roundz: unknown key"),
        (["tree.root.rounds=two"], "tree.root.rounds"),
        (["tree.edge.cohort=7"], "tree.edge.cohort: cohort of 7 is larger than the 6 children of node 'edge-en'"),
        (["tree.server.proxy_train=true"], "tree.server.proxy_train: node 'europe-west' has no proxy split"),
        (["tree.nodes.edge-xx.eta_down=0.5"], "tree.nodes.edge-xx: no such node"),
        (["tree.nodes.edge-de.cohort=9"], "tree.nodes.edge-de.cohort: cohort of 9"),
        (["tree.groups.europe-east=[de]"], "tree.groups: languages ['ru'] are not under any intermediate server"),
        (["tree.groups.europe-east=[de, ru, xx]"], "language 'xx' is not in data.source.languages"),
        (["tree.edge.opt_up.kind=adamz"], "unknown NODEOPT 'adamz'"),
        (["data.sizes.min=1"], "data.sizes.min"),
        (["tree.root"], "expected KEY=VALUE"),
        (["seed.x=1"], "seed is a value, not a section"),
        (
            ["tree.residuals.up=[{from: edge, to: edge-de}]"],
            "tree.residuals.up[0].to: 'edge-de' is not an ancestor of 'edge-en'",
        ),
        (
            ["tree.residuals.up=[{from: edge, to: root}, {from: root, to: europe-west}]"],
            "tree.residuals.up[1].to: 'europe-west' is not an ancestor of 'root'",
        ),
        (["tree.residuals.up=[{from: client, to: root}]"], "tree.residuals.up[0].from: 'en-00' is a client"),
        (
            ["tree.residuals.up=[{from: europe-west, to: root, select: loss}]"],
            "tree.residuals.up[0].select: 'loss' ranks clients by training loss",
        ),
        (
            ["tree.residuals.down=[{from: edge-en, to: root}]"],
            "tree.residuals.down[0].to: 'root' is not a descendant of 'edge-en'",
        ),
        (["tree.residuals.down=[{from: root, to: edge-xx}]"], "tree.residuals.down[0].to: 'edge-xx' matches no node"),
        (["tree.residuals.up=[{from: edge, to: root, k: 0}]"], "tree.residuals.up[0].k"),
        (["tree.residuals.up=[{source: edge, to: root}]"], "tree.residuals.up[0].source: unknown key"),
        (["tree.residuals.up=[{to: root}]"], "tree.residuals.up[0].from: Field required"),
        (["data.proxy.servers=[root, europe-north]"], "data.proxy.servers[1]: 'europe-north' is not a server"),
        (["data.proxy.train_per_language=0"], "tree.root.proxy_train: node 'root' has no proxy split"),
        (["runtime.executor=cluster"], "runtime: executor: cluster needs runtime.cluster"),
        (["runtime.cluster=tcp://127.0.0.1:8786"], "cluster is set but executor is 'local'"),
        (
            ["runtime.executor=cluster", "runtime.cluster=ray://head:10001"],
            "runtime.cluster: 'ray://head:10001' is not a Dask scheduler address such as tcp://127.0.0.1:8786 "
            "(Ray clusters are not supported",
        ),
        (
            ["runtime.executor=cluster", "runtime.cluster=tcp://10.0.0.1:8786"],
            "runtime.cluster: tcp://10.0.0.1:8786 is plain TCP to another machine (10.0.0.1): anyone who can reach "
            "that port can run code on every worker. Use tls://10.0.0.1:8786 with runtime.tls",
        ),
        (["runtime.executor=cluster", "runtime.cluster=tcp://gpu-box:8786"], "plain TCP to another machine (gpu-box)"),
        (
            ["runtime.tls={ca_file: ca.pem, cert_file: c.pem, key_file: c.key}"],
            "runtime.tls: certificates are set but runtime.cluster is not set",
        ),
        (["runtime.executor=threads"], "runtime.executor"),
        (["runtime.placement=fastest"], "runtime.placement"),
        (["runtime.workers_per_device=0"], "runtime.workers_per_device"),
        (["data.source={kind: prepared, languages: [en]}"], "data.source.path: Field required"),
        (["tree.client.proxy_train=async"], "tree.client.proxy_train: 'async' proxy training is for servers"),
        (["tree.root.proxy_train=later"], "tree.root.proxy_train"),
        (["tree.client.mode=async"], "tree.client.mode: a client has no children"),
        (["tree.edge.mode=later"], "tree.edge.mode"),
    ],
)
def test_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs" / "embedded.yaml", overrides)
    assert message in str(err.value)


def test_a_cluster_elsewhere_speaks_tls_unless_its_network_is_trusted():
    """docs/runtime.md, "A cluster over TLS": plain TCP only on this machine, or where the user says it is safe."""
    cluster = ["runtime.executor=cluster"]
    for address in ("tcp://127.0.0.1:8786", "tcp://127.3.2.1:8786", "tcp://localhost:8786", "tcp://[::1]:8786"):
        assert load_config(REPO / "configs" / "embedded.yaml", [*cluster, f"runtime.cluster={address}"])
    trusted = [*cluster, "runtime.cluster=tcp://10.0.0.1:8786", "runtime.trusted_network=true"]
    assert load_config(REPO / "configs" / "embedded.yaml", trusted).runtime.trusted_network
    tls = [*cluster, "runtime.cluster=tls://10.0.0.1:8786", "runtime.tls={ca_file: ca.pem, cert_file: c, key_file: k}"]
    runtime = load_config(REPO / "configs" / "embedded.yaml", tls).runtime
    assert runtime.tls is not None and runtime.tls.ca_file == str(Path.cwd() / "ca.pem")  # resumable from elsewhere
    assert load_config(REPO / "configs" / "embedded.yaml", [*cluster, "runtime.cluster=tls://10.0.0.1:8786"])


def test_set_overrides_by_dotted_path_with_yaml_values():
    cfg = load_config(
        REPO / "configs" / "embedded.yaml",
        ["tree.root.rounds=2", "tree.nodes.edge-de.eta_down=0.5", "data.source.languages=[en, de]", "tree.groups={}"],
    )
    assert cfg.tree.root.rounds == 2 and cfg.tree.nodes["edge-de"].eta_down == 0.5
    clients = [ClientInfo(f"{lang}-{i}", lang, 10) for lang in ("en", "de") for i in range(6)]
    tree = build_tree(cfg, clients)
    assert tree["edge-de"].settings.opt_down.eta == 0.5 and tree["edge-en"].settings.opt_down.eta == 1.0
    assert tree["edge-de"].parent == "root"  # no groups: edges under the root


def test_override_and_file_errors(tmp_path, monkeypatch):
    assert apply_override({"a": {"b": 1}}, "a.c=[1, 2]") == {"a": {"b": 1, "c": [1, 2]}}
    with pytest.raises(ConfigError, match="not found") as absolute:
        load_config(tmp_path / "missing.yaml")
    assert "current directory" not in str(absolute.value)
    monkeypatch.chdir(tmp_path)  # a relative path (the CLI's default config outside a checkout) says where it looked
    said = f"'configs/x.yaml' not found (relative to the current directory, {tmp_path})"
    with pytest.raises(ConfigError, match=re.escape(said)):
        load_config(Path("configs/x.yaml"))
    with pytest.raises(ConfigError, match="is a folder, not a YAML file"):  # it exists: "not found" misleads
        load_config(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("tree: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        config_from_dict([1, 2])
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing here yet\n")  # not a request for the built-in defaults
    with pytest.raises(ConfigError, match=r"empty\.yaml: the config file is empty"):
        load_config(empty)
    (tmp_path / "child.yaml").write_text("base: empty.yaml\nname: x\n")
    with pytest.raises(ConfigError, match=r"empty\.yaml: the config file is empty"):
        load_config(tmp_path / "child.yaml")


def test_a_file_that_is_not_utf8_is_named_with_its_line_and_the_encoding_it_needs(tmp_path):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("base: embedded.yaml\n# résumé\nname: café\n".encode("latin-1"))
    # the first bad byte: "é" of "résumé", line 2, column 4 ("# r" before it), offset 20 + 3
    said = f"{latin1}: not UTF-8 text: byte 0xe9 on line 2, column 4 (byte offset 23)"
    with pytest.raises(ConfigError, match=re.escape(said)) as raised:
        load_config(latin1)
    assert "must be UTF-8" in str(raised.value)
    (tmp_path / "child.yaml").write_text("base: latin1.yaml\nname: x\n")  # a base file is named, not its child
    with pytest.raises(ConfigError, match=re.escape(said)):
        load_config(tmp_path / "child.yaml")
    utf16 = tmp_path / "utf16.yaml"  # UTF-16 with its byte-order mark is YAML too: still read
    utf16.write_bytes("base: embedded.yaml\n# résumé\nname: cafe\n".encode("utf-16"))
    (tmp_path / "embedded.yaml").write_text((REPO / "configs" / "embedded.yaml").read_text())
    assert load_config(utf16).name == "cafe"


def test_residual_rules_resolve_to_links_and_receiver_optimisers():
    cfg = load_config(
        REPO / "configs" / "bhfl-full.yaml",
        ["tree.residuals.up=[{from: edge, to: root, k: 2, select: cosine, eta: 0.5}]"],
    )
    clients = [ClientInfo(f"{lang}-{i}", lang, 10) for lang in cfg.data.source.languages for i in range(6)]
    tree = build_tree(cfg, clients)
    up = tree["edge-de"].settings.res_up
    assert [(link.target, link.k, link.select) for link in up] == [("root", 2, "cosine")]
    assert [link.target for link in tree.root.settings.res_down] == [
        f"edge-{lang}" for lang in cfg.data.source.languages
    ]
    root_in = dict(tree.root.settings.res_in)
    assert root_in["up0"].eta == 0.5 and root_in["up0"].kind == tree.root.settings.opt_up.kind  # inherits the kind
    edge_in = dict(tree["edge-fr"].settings.res_in)
    assert edge_in["down0"] == tree["edge-fr"].settings.opt_down  # defaults: the receiver's own down settings
    assert not tree["europe-west"].settings.res_in and not tree["fr-0"].settings.res_up


def test_language_group_proxy_holders():
    cfg = load_config(
        REPO / "configs" / "embedded.yaml", ["data.proxy.servers=[root, server]", "tree.server.proxy_train=true"]
    )
    clients = [ClientInfo(f"{lang}-{i}", lang, 10) for lang in cfg.data.source.languages for i in range(6)]
    tree = build_tree(cfg, clients)
    assert tree["europe-west"].settings.train is not None and tree["edge-en"].settings.train is None


def test_proxy_training_alongside_the_children_is_a_server_setting():
    cfg = load_config(REPO / "configs" / "embedded.yaml", ["tree.root.proxy_train=async"])
    clients = [ClientInfo(f"{lang}-{i}", lang, 10) for lang in cfg.data.source.languages for i in range(6)]
    tree = build_tree(cfg, clients)
    assert tree.root.settings.proxy_async and tree.root.settings.train is not None
    assert not any(n.settings.proxy_async for n in tree if n.id != "root")
    default = build_tree(load_config(REPO / "configs" / "embedded.yaml"), clients)
    assert not default.root.settings.proxy_async and default.root.settings.train is not None


# ---------------------------------------------------------------- keys written twice


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text, line, key, first",
    [
        ("seed: 1\nname: x\nseed: 2\n", 3, "seed", 1),  # the issue's case: ran seed 2 and said nothing
        ("tree:\n  edge:\n    rounds: 1\n    cohort: 2\n    rounds: 3\n", 5, "rounds", 3),  # nested
        ("tree: {root: {rounds: 1, proxy_train: true, rounds: 2}}\n", 1, "rounds", 1),  # flow mappings
        ("tree:\n  residuals:\n    up:\n      - from: edge\n        to: root\n        from: root\n", 6, "from", 4),
        ("tree:\n  levels:\n    1: {rounds: 2}\n    1: {rounds: 3}\n", 4, 1, 3),  # an integer key
    ],
)
def test_a_key_written_twice_names_the_file_the_key_and_both_lines(tmp_path, text, line, key, first):
    path = _write(tmp_path / "config.yaml", f"base: {REPO / 'configs' / 'embedded.yaml'}\n{text}")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: line {line + 1}: key {key!r} is written twice (first on line {first + 1})"


def test_keys_written_twice_in_a_base_file_in_set_values_in_pipelines_and_in_sweeps(tmp_path):
    from bhfl_core.config.pipeline import load_pipeline
    from bhfl_core.config.sweep import load_sweep, parse_grid_option

    _write(tmp_path / "parent.yaml", "name: p\nseed: 1\nname: q\n")
    child = _write(tmp_path / "child.yaml", "base: parent.yaml\nseed: 2\n")
    with pytest.raises(ConfigError, match=r"parent\.yaml: line 3: key 'name' is written twice \(first on line 1\)"):
        load_config(child)
    with pytest.raises(ConfigError, match=r"^--set tree\.edge: value .*line 1: key 'rounds' is written twice"):
        load_config(REPO / "configs" / "embedded.yaml", ["tree.edge={rounds: 1, rounds: 2}"])
    fedavg = REPO / "configs" / "fedavg.yaml"
    pipeline = _write(tmp_path / "p.yaml", f"name: p\nstages:\n  a:\n    base: {fedavg}\n    seed: 1\n    seed: 2\n")
    with pytest.raises(ConfigError, match=r"p\.yaml: line 6: key 'seed' is written twice \(first on line 5\)"):
        load_pipeline(pipeline)
    sweep = _write(tmp_path / "s.yaml", f"base: {fedavg}\ngrid:\n  seed: [1]\n  tree.root.rounds: [1]\n  seed: [2]\n")
    with pytest.raises(ConfigError, match=r"s\.yaml: line 5: key 'seed' is written twice \(first on line 3\)"):
        load_sweep(sweep)
    with pytest.raises(ConfigError, match=r"^--grid seed: .*line 1: key 'a' is written twice"):
        parse_grid_option("seed={a: 1, a: 2}")


def test_a_merge_key_may_be_overridden_and_aliases_still_work(tmp_path):
    # `<<: *anchor` then a key of its own is what merge keys are for, not a key written twice
    text = (
        "tree:\n  edge: &e {rounds: 2, eta_up: 0.5}\n  server:\n    <<: *e\n    rounds: 1\n"
        "  root: {train: &t {lr: 0.01, epochs: 3}}\n  client: {train: *t}\n"
    )
    cfg = load_config(_write(tmp_path / "c.yaml", f"base: {REPO / 'configs' / 'embedded.yaml'}\n{text}"))
    assert (cfg.tree.server.rounds, cfg.tree.server.eta_up, cfg.tree.edge.rounds) == (1, 0.5, 2)
    assert (cfg.tree.client.train.lr, cfg.tree.client.train.epochs) == (0.01, 3)


@pytest.mark.integration  # a `bhfl` subprocess per command (about 0.6 s each): nothing starts, nothing is written
def test_the_cli_shows_a_key_written_twice_as_its_one_paragraph_error(tmp_path):
    import subprocess
    import sys

    config = _write(tmp_path / "dup.yaml", f"base: {REPO / 'configs' / 'embedded.yaml'}\nseed: 1\nseed: 2\n")
    for args in (["run", str(config)], ["sweep", "--grid", "seed={a: 1, a: 2}"]):
        out = subprocess.run(
            [sys.executable, "-m", "flows.cli.app", *args, "--run-dir", str(tmp_path / "runs")],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert out.returncode == 2, out.stderr
        assert "is written twice (first on line" in out.stderr and "Traceback" not in out.stderr + out.stdout
    assert not (tmp_path / "runs" / "mlflow.db").exists()


# ---------------------------------------------------------------- cohort fractions


@pytest.mark.parametrize(
    "fraction, children, sampled",
    [(0.5, 5, 2), (0.5, 7, 4), (0.5, 3, 2), (0.3, 5, 2), (0.7, 5, 4), (0.9, 5, 4), (0.1, 5, 1), (1.0, 6, 6)],
)
def test_a_fractional_cohort_rounds_half_to_even_and_samples_at_least_one(fraction, children, sampled):
    """docs/config.md (`cohort`): Python's round, so 2.5 -> 2 and 3.5 -> 4; 0.3 x 5 is 1.5 in floats -> 2."""
    overrides = [f"data.clients_per_language={children}", f"tree.edge.cohort={fraction}"]
    cfg = load_config(REPO / "configs" / "embedded.yaml", [*overrides, "data.source.languages=[en]", "tree.groups={}"])
    tree = build_tree(cfg, [ClientInfo(f"en-{i}", "en", 10) for i in range(children)])
    assert tree["edge-en"].settings.cohort == sampled
