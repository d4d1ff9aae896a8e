"""Tempo's Eq. 9 (seeds/001) with hand-computed values, its degenerate cases and its schedule file."""

import math
from pathlib import Path

import pytest
import torch

from bhfl_core.algorithm.tempo import OMEGA_FLOOR, eq9_direct, omega, tempo_epochs

E = math.e


def test_three_institutions_powers_of_e() -> None:
    # ln omega = 1, 2, 3; min = 1, max = 3, c = 4: (c/2)/(1-3) = -1
    #   ln 3: -1 * (9 + 1 - 12) = 2   (largest omega: c/2)
    #   ln 2: -1 * (6 + 1 - 12) = 5
    #   ln 1: -1 * (3 + 1 - 12) = 8   (smallest omega: 2c)
    omegas = {"edge-a": E, "edge-b": E**2, "edge-c": E**3}
    assert tempo_epochs(omegas, 4) == {"edge-a": 8, "edge-b": 5, "edge-c": 2}
    assert eq9_direct(omegas, 4) == pytest.approx({"edge-a": 8.0, "edge-b": 5.0, "edge-c": 2.0})
    # c = 6: (c/2)/(1-3) = -1.5 -> 3, 7.5 -> 8, 12
    assert tempo_epochs(omegas, 6) == {"edge-a": 12, "edge-b": 8, "edge-c": 3}


def test_four_institutions_rounding() -> None:
    # ln omega = 1..4, c = 3: (c/2)/(1-4) = -0.5
    #   ln 4: -0.5 * (12 + 1 - 16) = 1.5 -> 2;  ln 3: -0.5 * (9 - 15) = 3 -> 3 (exact, no ceil up)
    #   ln 2: -0.5 * (6 - 15) = 4.5 -> 5;        ln 1: -0.5 * (3 - 15) = 6
    omegas = {"a": E, "b": E**2, "c": E**3, "d": E**4}
    assert tempo_epochs(omegas, 3) == {"a": 6, "b": 5, "c": 3, "d": 2}
    direct = eq9_direct(omegas, 3)
    assert {m: math.ceil(round(v, 9)) for m, v in direct.items()} == tempo_epochs(omegas, 3)


def test_scale_invariance_and_order() -> None:
    # Eq. 9 depends on ratios of omegas only: multiplying all omegas by k changes nothing.
    omegas = {"x": 0.5, "y": 2.0, "z": 8.0}
    assert tempo_epochs(omegas, 6) == tempo_epochs({m: 10 * w for m, w in omegas.items()}, 6)
    # ln spacing 0, ln 4, ln 16: s = 1, 1/2, 0 -> 3 * (1 + 3s) = 12, 7.5 -> 8, 3
    assert tempo_epochs(omegas, 6) == {"x": 12, "y": 8, "z": 3}
    assert list(tempo_epochs(omegas, 6)) == ["x", "y", "z"]


def test_all_equal_keeps_c() -> None:
    assert tempo_epochs({"a": 0.3, "b": 0.3, "c": 0.3}, 5) == {"a": 5, "b": 5, "c": 5}
    assert tempo_epochs({"a": 0.3, "b": 0.3 * (1 + 1e-13)}, 5) == {"a": 5, "b": 5}  # float noise, not a spread
    assert tempo_epochs({"only": 1.7}, 2) == {"only": 2}
    assert tempo_epochs({"a": 0.0, "b": 0.0}, 3) == {"a": 3, "b": 3}
    assert tempo_epochs({}, 3) == {}


def test_zero_omega_is_clamped() -> None:
    # omega 0 -> 1e-12: ln = -27.631021..., the smallest, so 2c; ln 1 = 0; ln e = 1 (the largest: c/2).
    # c = 4, span = 1 + 27.631021 = 28.631021; for ln 1: s = 1 / 28.631021 = 0.034927,
    # 2 * (1 + 3 * 0.034927) = 2.2096 -> 3
    omegas = {"zero": 0.0, "one": 1.0, "e": E}
    assert tempo_epochs(omegas, 4) == {"zero": 8, "one": 3, "e": 2}
    assert tempo_epochs(omegas, 4) == tempo_epochs({"zero": OMEGA_FLOOR, "one": 1.0, "e": E}, 4)


def test_at_least_one_epoch_and_bad_input() -> None:
    assert tempo_epochs({"a": 1.0, "b": E}, 1) == {"a": 2, "b": 1}  # c/2 = 0.5 -> ceil 1
    with pytest.raises(ValueError, match="omega"):
        tempo_epochs({"a": -1.0, "b": 1.0}, 3)
    with pytest.raises(ValueError, match="omega"):
        tempo_epochs({"a": float("nan"), "b": 1.0}, 3)
    with pytest.raises(ValueError, match="c"):
        tempo_epochs({"a": 1.0}, 0)


def test_omega_is_the_l2_distance() -> None:
    assert omega(torch.tensor([3.0, 4.0, 1.0]), torch.tensor([0.0, 0.0, 1.0])) == 5.0
    assert omega(torch.zeros(3), torch.zeros(3)) == 0.0


REPO = Path(__file__).resolve().parents[2]


def test_config_key_needs_edges_under_the_root() -> None:
    from bhfl_core.config.base import ConfigError
    from bhfl_core.config.loader import load_config

    assert load_config(REPO / "configs" / "tempo.yaml").tree.tempo
    assert not load_config(REPO / "configs" / "hierfavg.yaml").tree.tempo
    with pytest.raises(ConfigError, match=r"tree\.tempo.*tree\.groups"):
        load_config(REPO / "configs" / "embedded.yaml", ["tree.tempo=true"])
    with pytest.raises(ConfigError, match=r"tree\.tempo.*tree\.flat"):
        load_config(REPO / "configs" / "fedavg.yaml", ["tree.tempo=true"])
