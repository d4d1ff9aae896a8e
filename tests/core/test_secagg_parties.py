"""Who can unmask what in a secure-aggregation round (secagg_parties.py through secure_aggregation.MaskedSum).

The server object must end a round holding the sum and nothing that opens one client's
vector: no share of a survivor's key, no share of a dropped client's self-mask seed, and
no way to unmask below the threshold. The unmasked sum must be the exact integer sum for
the complete and the sparse (SecAgg+) graph, with dropouts, seeded or secure.
"""

from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

from bhfl_core.algorithm.csprng import prg
from bhfl_core.algorithm.node_state import Caller
from bhfl_core.algorithm.privacy_params import SecAggParams
from bhfl_core.algorithm.rule_registry import AggregateParams
from bhfl_core.algorithm.rules import rule_for
from bhfl_core.algorithm.secagg_crypto import agreed_seed, private_key
from bhfl_core.algorithm.secagg_parties import KEY, SELF, RoundDealer, SecAggClient, SecureAggregationError
from bhfl_core.algorithm.secure_aggregation import MaskedSum

ROUND = Caller("edge-en", 2)
COMPLETE = SecAggParams(threshold=4, mask_seed=11)  # 6 clients: exactly 4 survive 2 dropouts
SPARSE = SecAggParams(threshold=3, mask_seed=11, neighbours=4)  # 12 clients, 4 neighbours each
gen = torch.Generator().manual_seed(0)
UPDATES = {f"c{i:02d}": torch.randint(-(2**20), 2**20, (3000,), generator=gen).double() for i in range(12)}


def masked_round(params, peers, contributors, drawn=b""):
    fold = MaskedSum(params, ROUND, peers, drawn=drawn)
    for member in contributors:  # fraction_bits 0 below: q_u is the update itself
        fold.add(member, UPDATES[member], 1.0)
    return fold


def exact(contributors):
    return sum(UPDATES[m].to(torch.int64) for m in contributors)


@pytest.mark.parametrize(
    "params, clients, dropped",
    [
        (COMPLETE, 6, ("c01", "c04")),
        (SPARSE, 12, ("c03", "c07", "c08")),
        (replace(COMPLETE, randomness="secure"), 6, ("c05",)),
        (replace(SPARSE, randomness="secure"), 12, ()),
    ],
)
def test_the_unmasked_sum_is_the_exact_integer_sum_with_dropouts_on_either_graph(params, clients, dropped):
    params = replace(params, fraction_bits=0)
    peers = list(UPDATES)[:clients]
    survivors = [p for p in peers if p not in dropped]
    drawn = rule_for(AggregateParams(wrappers=(params,))).plan({}, peers).drawn  # secure: 32 bytes from the OS
    fold = masked_round(params, peers, survivors, drawn)
    assert torch.equal(fold.unmasked()[:-1], exact(survivors)) and fold.totals() == {"clamped": 0}
    if params.randomness == "secure":  # other keys and masks each round, the same sum
        again = masked_round(
            params, peers, survivors, rule_for(AggregateParams(wrappers=(params,))).plan({}, peers).drawn
        )
        assert not torch.equal(again.masked, fold.masked) and torch.equal(again.unmasked(), fold.unmasked())


def test_the_server_ends_holding_no_survivors_key_and_no_dropped_clients_self_mask_seed():
    peers, dropped = list(UPDATES), ("c03", "c07", "c08")
    survivors = [p for p in peers if p not in dropped]
    fold = masked_round(SPARSE, peers, survivors)
    fold.unmasked()
    server, dealer = fold.server, fold.dealer()
    assert set(server.shares[SELF]) == set(survivors) and set(server.shares[KEY]) == set(dropped)
    assert set(server.recovered[SELF]) == set(survivors) and set(server.recovered[KEY]) == set(dropped)
    never = {dealer._secret(KEY, p) for p in survivors} | {dealer._secret(SELF, p) for p in dropped}
    held = _everything(vars(server))
    assert not never & held["bytes"] and not {int.from_bytes(s, "big") for s in never} & held["int"]
    assert held["types"] <= {dict, list, tuple, str, int, bytes, torch.Tensor}  # no party object, no dealer


def test_a_client_reveals_one_share_per_peer_never_both_and_none_below_the_threshold():
    peers = list(UPDATES)[:6]
    client = RoundDealer(bytes(32), b"edge-en:2", peers, None, 4).client("c00", with_shares=True)
    answer = client.respond(["c00", "c01", "c02", "c03"], ["c04", "c05"])
    assert answer == {
        **{p: client.received[SELF][p] for p in peers[:4]},
        **{p: client.received[KEY][p] for p in peers[4:]},
    }
    with pytest.raises(SecureAggregationError, match="refuses to reveal the key share of 'c03': it revealed the other"):
        client.respond(["c00", "c01", "c02", "c04"], ["c03", "c05"])
    with pytest.raises(SecureAggregationError, match="naming a party both ways"):
        client.respond(["c00", "c01", "c02", "c03"], ["c03"])
    with pytest.raises(SecureAggregationError, match="3 survivors, fewer than the threshold 4"):
        client.respond(["c00", "c01", "c02"], ["c03", "c04", "c05"])


def test_below_the_threshold_the_server_cannot_unmask_and_says_which_server():
    with pytest.raises(SecureAggregationError, match=r"'edge-en' \(round 2\): 3 of 6 children .* threshold 4"):
        masked_round(COMPLETE, list(UPDATES)[:6], ["c00", "c02", "c05"]).unmasked()
    peers = list(UPDATES)
    gone = masked_round(SPARSE, peers, []).dealer().graph["c00"][:3]  # 3 of c00's 4 neighbours drop: 2 holders left
    fold = masked_round(SPARSE, peers, [p for p in peers if p not in gone])
    with pytest.raises(SecureAggregationError, match=r"at 'edge-en': 2 shares of 'c00'.s self-mask seed came back"):
        fold.unmasked()


def test_a_late_clients_vector_stays_hidden_once_its_pairwise_masks_are_removed():
    """A client whose vector arrives after the server declared it dropped: the server rebuilds its key and can remove
    its pairwise masks from the late vector; only its self-mask still hides its update (why self-masks exist)."""
    peers = list(UPDATES)[:6]
    params = replace(COMPLETE, fraction_bits=0)
    fold = masked_round(params, peers, peers[:5])
    fold.unmasked()
    late = masked_round(params, peers, ["c05"]).masked[:-1]  # what c05 sent, too late
    key, server = private_key(fold.server.recovered[KEY]["c05"]), fold.server
    opened = late.clone()
    for other in peers[:5]:
        pair = prg(agreed_seed(key, server.public_keys[other], server.context), late.numel(), 48)
        opened = (opened + pair) & (2**48 - 1)  # c05 > every other: it subtracted each pair
    assert not torch.equal(opened, UPDATES["c05"].to(torch.int64) & (2**48 - 1))
    assert chisquare(torch.bincount(opened >> 40, minlength=256).numpy()).pvalue > 1e-4


def _everything(value, out=None):
    """Every bytes, int and container type reachable from ``value`` (an object's attributes included)."""
    out = out if out is not None else {"bytes": set(), "int": set(), "types": set()}
    out["types"].add(type(value))
    if isinstance(value, bytes):
        out["bytes"].add(value)
    elif isinstance(value, int):
        out["int"].add(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _everything(k, out), _everything(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _everything(v, out)
    elif not isinstance(value, (str, torch.Tensor)):
        _everything(vars(value), out)
    return out


def test_a_client_object_holds_only_its_neighbourhood():
    peers = [f"p{i:03d}" for i in range(300)]
    dealer = RoundDealer(bytes(32), b"", peers, 8, 5)
    client = dealer.client("p123", with_shares=True)
    assert isinstance(client, SecAggClient) and len(client.neighbour_keys) == 8 == len(dealer._publics)
    assert set(client.received[KEY]) == set(client.received[SELF]) == {"p123", *dealer.graph["p123"]}
