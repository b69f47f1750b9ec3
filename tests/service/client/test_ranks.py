"""Per-rank fetch: a training rank's pipeline stage and context-parallel chunks, sliced by a real sidecar.

The CP split is checked against Megatron-LM's own operation on a tensor (the view into `2·cp` chunks and
`index_select([r, 2·cp−1−r])` of `_get_batch_on_this_cp_rank_per_sequence_balancing`), the stage layers
against the cover every layer exactly once; the fetch against slicing the whole record here.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import live_server

from engine_ext.core.records import routed_experts_url
from service.client import RoutedExpertsRef
from service.client.ranks import Place, cp_tokens, fetch_rank, layers_param, stage_layers
from service.client.refs import SidecarPool
from service.server.settings import Settings
from service.spool import Spool


def megatron_cp_positions(seq_len: int, cp: int, r: int) -> list[int]:
    """Megatron's balanced split applied to positions (padded to a multiple of 2·cp, as slime pads). torch is
    imported here, not at collection, where every xdist worker would import it."""
    torch = pytest.importorskip("torch")
    size = -(-seq_len // (2 * cp))
    val = torch.arange(2 * cp * size).view(1, 2 * cp, size)
    val = val.index_select(1, torch.tensor([r, 2 * cp - r - 1])).view(1, -1)
    return [p for p in val[0].tolist() if p < seq_len]


@pytest.mark.parametrize("seq_len", [1, 7, 64, 1001])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_cp_chunks_are_megatrons_and_cover_the_sequence_once(seq_len: int, cp: int) -> None:
    seen: list[int] = []
    for r in range(cp):
        mine = [p for lo, hi in cp_tokens(seq_len, cp, r) for p in range(lo, hi)]
        if cp > 1:
            assert mine == megatron_cp_positions(seq_len, cp, r)
        seen += mine
        contiguous = [p for lo, hi in cp_tokens(seq_len, cp, r, balanced=False) for p in range(lo, hi)]
        assert contiguous == sorted(contiguous)
    assert sorted(seen) == list(range(seq_len))


def test_cp_rank_2_of_4_takes_chunks_2_and_5() -> None:
    assert cp_tokens(800, 4, 2) == ((200, 300), (500, 600))


@pytest.mark.parametrize(
    ("kwargs", "pp"),
    [({}, 4), ({"vp_size": 2}, 4), ({"first_stage": 2, "last_stage": 6}, 4), ({"first_stage": 4}, 3)],
)
def test_stage_layers_cover_every_layer_once(kwargs: dict, pp: int) -> None:
    held = [x for r in range(pp) for lo, hi in stage_layers(24, pp, r, **kwargs) for x in range(lo, hi)]
    assert sorted(held) == list(range(24))


def test_stage_layers_as_megatron_places_them() -> None:
    assert stage_layers(24, 4, 1) == ((6, 12),)
    assert stage_layers(24, 4, 1, vp_size=2) == ((3, 6), (15, 18))  # chunk v at v·24/2 + 1·3
    assert stage_layers(24, 4, 0, first_stage=2, last_stage=6) == ((0, 2),)
    assert stage_layers(24, 4, 2, first_stage=2, last_stage=6) == ((10, 18),)
    assert layers_param(((3, 6), (15, 18))) == "3-5,15-17"
    with pytest.raises(ValueError, match="multiple"):
        stage_layers(10, 4, 0)


LAYERS = (1, 2, 4, 5, 7)  # MoE layers of an 8-layer model


def test_each_rank_gets_exactly_its_rows_and_less_than_the_whole(tmp_path) -> None:
    spool = Spool(tmp_path / "spool")
    rng = np.random.default_rng(0)
    seq_lens = [301, 96]
    whole = {}
    for i, n in enumerate(seq_lens):
        whole[f"r{i}"] = rng.integers(0, 64, (n - 1, len(LAYERS), 8), dtype=np.uint8)  # no row for the last token
        writer = spool.writer(f"r{i}", num_experts=64, topk=8, layers=LAYERS, prompt_len=10, num_hidden_layers=8)
        writer.append(whole[f"r{i}"])
        writer.finalize()
    with live_server(Settings(spool_dir=spool.root)) as url:
        refs = [RoutedExpertsRef(rid=rid, url=routed_experts_url(url, rid)) for rid in whole]
        with SidecarPool() as pool:
            for pp_rank in range(2):
                for cp_rank in range(2):
                    place = Place(pp_size=2, pp_rank=pp_rank, cp_size=2, cp_rank=cp_rank)
                    got = fetch_rank(refs, seq_lens, place, 8, pool=pool)
                    stage = [x for lo, hi in place.layers(8) for x in range(lo, hi)]
                    cols = [j for j, layer in enumerate(LAYERS) if layer in stage]
                    for r, n in zip(got, seq_lens, strict=True):
                        rows = [p for lo, hi in place.tokens(n) for p in range(lo, min(hi, n - 1))]
                        np.testing.assert_array_equal(r.array, whole[r.rid][rows][:, cols])
                        assert r.layers == tuple(LAYERS[j] for j in cols)
