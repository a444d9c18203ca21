# SPDX-License-Identifier: Apache-2.0
"""DFlash 2 drafters: config keys and checkpoints, the block-local dynamic conv, the selector walk,
acceptance over candidates, and the reference loop (greedy = plain decoding; sampling lossless)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_trt.errors import CheckpointError, ConfigError, IncompatiblePairError
from dflash_trt.layers.kv_cache import context_index, slot_mapping
from dflash_trt.models.checkpoint import load_drafter, save_drafter
from dflash_trt.models.dflash2 import DFlash2Drafter, GroupedDynamicCausalConv, grouped_dynamic_conv
from dflash_trt.models.dflash_config import TargetInfo, parse_dflash_config, validate_pair
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.reference.generate import spec_generate
from dflash_trt.reference.hf_target import HFTarget
from dflash_trt.spec.accept import rejection_accept, rejection_accept_candidates
from dflash_trt.spec.sampling import PURPOSE_ACCEPT, PURPOSE_EMIT, SamplingConfig, uniform
from dflash_trt.spec.selector import propose, selector_walk, top_candidates
from tests.conftest import drafter_hf_config, make_drafter, make_target
from tests.test_sampling import chi_square_p, exact_joint


def d2_config(**changes):
    target = make_target()
    cfg = drafter_hf_config(target, dflash2=True)
    for key, value in changes.items():
        if key.startswith("dc_"):
            cfg["dflash_config"][key[3:]] = value
        elif value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    return cfg


# --- config --------------------------------------------------------------------------------------
def test_dflash2_config_parses_and_round_trips():
    c = parse_dflash_config(hf_config=d2_config())
    assert c.architecture == "DFlash2DraftModel" and c.dflash2 is not None
    assert (c.dflash2.conv_kernel_size, c.dflash2.conv_group_size) == (3, 8)
    assert (c.dflash2.selector_rank, c.dflash2.selector_top_k) == (6, 4)
    hf = c.to_hf_config()
    assert hf["architectures"] == ["DFlash2DraftModel"] and hf["dflash_config"]["selector_top_k"] == 4
    assert parse_dflash_config(hf_config=hf) == c
    # the keys may also sit at the top level (the reference reads dflash_config first, then the top)
    top = d2_config(dc_selector_rank=None, selector_rank=9)
    assert parse_dflash_config(hf_config=top).dflash2.selector_rank == 9


def test_v1_resolves_exactly_as_before():
    target = make_target()
    v1 = drafter_hf_config(target)
    c = parse_dflash_config(hf_config=v1)
    assert c.dflash2 is None and c.architecture == "DFlashDraftModel"
    assert c.to_hf_config()["architectures"] == ["DFlashDraftModel"]
    assert "conv_kernel_size" not in json.dumps(c.to_hf_config())
    # DFlash 2 keys on a v1 checkpoint change nothing (kept verbatim, as any unknown key)
    stray = parse_dflash_config(hf_config={**v1, "selector_top_k": 3})
    assert stray == c and stray.extra["selector_top_k"] == 3


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"dc_conv_group_size": 7}, r"dflash_config.conv_group_size=7: must divide hidden_size=48"),
        ({"dc_conv_kernel_size": 0}, r"dflash_config.conv_kernel_size=0: must be an integer >= 1"),
        ({"dc_selector_top_k": 0}, r"dflash_config.selector_top_k=0: must be an integer >= 1"),
        ({"dc_selector_top_k": 62}, r"dflash_config.selector_top_k=62: must be <= vocab_size=61"),
        ({"dc_selector_rank": 0}, r"dflash_config.selector_rank=0: must be an integer >= 1"),
        ({"dc_selector_rank": 2.5}, r"dflash_config.selector_rank=2.5: must be an integer"),
        ({"dc_conv_kernel_size": None}, r"dflash_config.conv_kernel_size=None: missing.*fix: add it \(2 in"),
        ({"vocab_size": None}, r"vocab_size=None: a DFlash2DraftModel needs it"),
        ({"architectures": ["Foo"]}, r"architectures=\['Foo'\]: not a z-lab DFlash drafter"),
        ({"architectures": ["DFlashDraftModel", "DFlash2DraftModel"]}, r"names both DFlash versions"),
    ],
)
def test_dflash2_config_errors_name_field_and_value(changes, pattern):
    with pytest.raises(ConfigError, match=pattern):
        parse_dflash_config(hf_config=d2_config(**changes))


def test_pair_check_needs_one_codebook_row_per_target_token():
    c = parse_dflash_config(hf_config=d2_config())
    validate_pair(c, TargetInfo(48, 6, 61))
    with pytest.raises(
        IncompatiblePairError, match=r"drafter.vocab_size=61: the DFlash 2 selector's codebooks"
    ):
        validate_pair(c, TargetInfo(48, 6, 64))


# --- checkpoints -----------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["plain", "swa"])
def test_published_layout_round_trip(tmp_path, variant):
    drafter = make_drafter(make_target(), variant=variant, dflash2=True)
    assert isinstance(drafter, DFlash2Drafter)
    save_drafter(drafter, tmp_path / "d")
    names = set(load_file(str(tmp_path / "d" / "model.safetensors")))
    layers = drafter.config.num_hidden_layers
    assert len(names) == (11 + 4) * layers + 3 + 3
    assert {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
            "candidate_selector.hidden_projection.weight", "layers.0.attention_conv.base_kernel",
            "layers.0.mlp_conv.kernel_projection.weight"} <= names  # fmt: skip
    state = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert state["layers.0.attention_conv.base_kernel"].shape == (2, 3, 48)
    assert state["layers.0.attention_conv.kernel_projection.weight"].shape == (2 * 3 * 6, 48)  # [2KG, D]
    assert state["candidate_selector.successor_codebook"].shape == (61, 6)
    again = load_drafter(tmp_path / "d")
    assert isinstance(again, DFlash2Drafter) and again.config == drafter.config
    for k, v in drafter.state_dict().items():
        assert torch.equal(again.state_dict()[k], v)
    if variant == "swa":
        assert [layer.causal for layer in again.layers] == [True, True, False]


def test_codebooks_load_in_both_spellings(tmp_path):
    drafter = make_drafter(make_target(), dflash2=True)
    save_drafter(drafter, tmp_path / "d")
    path = tmp_path / "d" / "model.safetensors"
    state = load_file(str(path))
    suffixed = {(f"{k}.weight" if k.endswith("_codebook") else k): v for k, v in state.items()}
    save_file(suffixed, str(path))
    again = load_drafter(tmp_path / "d")
    assert torch.equal(
        again.candidate_selector.predecessor_codebook, drafter.candidate_selector.predecessor_codebook
    )
    save_file({**suffixed, "candidate_selector.successor_codebook": state["candidate_selector.successor_codebook"].clone()},
              str(path))  # fmt: skip
    with pytest.raises(
        CheckpointError, match=r"both 'candidate_selector.successor_codebook' and .*\.weight'"
    ):
        load_drafter(tmp_path / "d")


def test_missing_extra_and_misshaped_dflash2_tensors(tmp_path):
    drafter = make_drafter(make_target(), dflash2=True)
    save_drafter(drafter, tmp_path / "d")
    path = tmp_path / "d" / "model.safetensors"
    state = load_file(str(path))
    broken = {k: v for k, v in state.items() if k != "layers.1.mlp_conv.base_kernel"}
    save_file(broken, str(path))
    with pytest.raises(
        CheckpointError, match=r"\(DFlash2DraftModel\): missing 1 tensor.*mlp_conv.base_kernel"
    ):
        load_drafter(tmp_path / "d")
    save_file({**state, "candidate_selector.bias": torch.zeros(3)}, str(path))
    with pytest.raises(CheckpointError, match=r"unexpected 1 tensor.*candidate_selector.bias"):
        load_drafter(tmp_path / "d")
    save_file({**state, "candidate_selector.hidden_projection.weight": torch.zeros(5, 48)}, str(path))
    with pytest.raises(
        CheckpointError,
        match=r"candidate_selector.hidden_projection.weight has shape \(5, 48\), config implies \(6, 48\)",
    ):
        load_drafter(tmp_path / "d")
    # a v1 config over DFlash 2 weights (and the reverse) says which it is
    save_file(state, str(path))
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    (tmp_path / "d" / "config.json").write_text(json.dumps({**cfg, "architectures": ["DFlashDraftModel"]}))
    with pytest.raises(CheckpointError, match=r"unexpected .*fix: the weights are a DFlash 2 drafter's"):
        load_drafter(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    save_file({k: v for k, v in state.items() if "_conv." not in k and "selector" not in k}, str(path))
    with pytest.raises(
        CheckpointError, match=r"fix: config.json says DFlash2DraftModel but the weights lack"
    ):
        load_drafter(tmp_path / "d")


# --- the conv ----------------------------------------------------------------------------------------
def conv_by_definition(x, coeff, base, group_size):
    """out[i, c] = sum_t (base[t, c] + coeff[i, t, c // gs]) * x[i - t, c], zero padding: loops."""
    blk = x.shape[-2]
    out = torch.zeros_like(x)
    for i in range(blk):
        for t in range(base.shape[0]):
            if i - t >= 0:
                dyn = coeff[..., i, t, :].repeat_interleave(group_size, dim=-1)  # [..., D]
                out[..., i, :] += (base[t] + dyn) * x[..., i - t, :]
    return out


@pytest.mark.parametrize(("blk", "k"), [(5, 2), (4, 3), (2, 4), (1, 2)])
def test_conv_matches_its_definition(blk, k):
    g = torch.Generator().manual_seed(blk * 10 + k)
    x = torch.randn(3, 2, blk, 24, generator=g, dtype=torch.float64)
    coeff = torch.randn(3, 2, blk, k, 3, generator=g, dtype=torch.float64)
    base = torch.randn(k, 24, generator=g, dtype=torch.float64)
    torch.testing.assert_close(
        grouped_dynamic_conv(x, coeff, base, group_size=8), conv_by_definition(x, coeff, base, 8)
    )


def test_conv_is_causal_and_block_local():
    """Changing slot i changes only slots >= i of the same block; the anchor reads zero padding."""
    conv = GroupedDynamicCausalConv(16, parse_dflash_config(hf_config=d2_config(hidden_size=16)).dflash2)
    torch.nn.init.normal_(conv.base_kernel)
    torch.nn.init.normal_(conv.kernel_projection.weight)
    x = torch.randn(2, 5, 16)
    out, coeff = conv.prepare(x)
    y = x.clone()
    y[0, 2] += 1.0
    out2, _ = conv.prepare(y)
    assert torch.equal(out2[0, :2], out[0, :2]) and not torch.equal(out2[0, 2:4], out[0, 2:4])
    assert torch.equal(out2[1], out[1])
    # slot 0 = (base[0] + dyn[0]) * x[0] only: no tap reaches a previous block or round
    dyn0 = coeff[:, 0, 0, 0, :].repeat_interleave(8, dim=-1)
    torch.testing.assert_close(out[:, 0], (conv.base_kernel[0, 0] + dyn0) * x[:, 0])
    conv.reset_identity()
    out, coeff = conv.prepare(x)
    assert torch.equal(out, x) and torch.equal(conv.finish(x * 2, coeff), x * 2)


def test_ragged_batch_never_reads_across_requests():
    """forward_block over a ragged batch (different contexts and block lengths) equals each request
    run alone with its own block length, and perturbing one request's block leaves the others as they
    were: the conv (and the attention) stay inside a request's block."""
    target = make_target()
    drafter = make_drafter(target, dflash2=True, block_size=6, std=0.4)
    drafter.bind_target(target.get_input_embeddings().weight, target.lm_head.weight)
    page, pages = 4, 4
    cache = drafter.make_cache(num_pages=2 * pages + 1, page_size=page)
    tables = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    starts, blens = torch.tensor([9, 5]), torch.tensor([6, 3])
    kd = drafter.config.num_target_features * drafter.config.hidden_size
    g = torch.Generator().manual_seed(0)
    for i in range(2):
        pos = torch.arange(int(starts[i]))
        drafter.inject_context(
            cache,
            torch.randn(len(pos), kd, generator=g),
            pos,
            slot_mapping(tables[i : i + 1], pos[None], page)[0],
        )
    emb = torch.randn(2, 6, 48, generator=g)
    pos = starts[:, None] + torch.arange(6)
    with torch.no_grad():
        both = drafter.forward_block(cache, emb, pos, context_index(tables, page), starts, blens)
        for i in range(2):
            b = int(blens[i])
            alone = drafter.forward_block(
                cache,
                emb[i : i + 1, :b],
                pos[i : i + 1, :b],
                context_index(tables[i : i + 1], page),
                starts[i : i + 1],
            )
            torch.testing.assert_close(both[i, :b], alone[0], rtol=1e-5, atol=1e-5)
        bumped = emb.clone()
        bumped[0] += 3.0
        again = drafter.forward_block(cache, bumped, pos, context_index(tables, page), starts, blens)
    assert torch.equal(again[1, :3], both[1, :3]) and not torch.allclose(again[0], both[0])


def test_a_compiled_block_pass_traces_one_dflash2_layer_and_reuses_it():
    """The DFlash 2 layer (convs around attention and the MLP) is a repeated region as v1's is: a
    compiled block pass of a 3-layer drafter calls one traced layer subgraph three times, each with
    its own weights, convs and cache, and equals the eager pass."""
    target = make_target()
    drafter = make_drafter(target, dflash2=True, layers=3, block_size=6, std=0.4)
    drafter.bind_target(target.get_input_embeddings().weight, target.lm_head.weight)
    cache = drafter.make_cache(num_pages=3, page_size=4)
    tables = torch.tensor([[1, 2]])
    pos = torch.arange(5)
    kd = drafter.config.num_target_features * drafter.config.hidden_size
    g = torch.Generator().manual_seed(0)
    drafter.inject_context(cache, torch.randn(5, kd, generator=g), pos, slot_mapping(tables, pos[None], 4)[0])
    emb = torch.randn(1, 6, 48, generator=g)
    block_pos = 5 + torch.arange(6)[None]
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, _inputs):  # dynamo's graph, run as traced
        graphs.append(gm)
        return gm.forward

    def run(fn):
        with torch.no_grad():
            return fn(cache, emb, block_pos, context_index(tables, 4), torch.tensor([5]))

    want = run(drafter.forward_block)
    got = run(torch.compile(drafter.forward_block, backend=capture, fullgraph=True))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    (gm,) = graphs
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "invoke_subgraph" in str(n.target)]
    assert len(calls) == 3  # one call per layer ...
    assert len({n.args[0].target for n in calls}) == 1  # ... of a single traced subgraph


# --- the selector ----------------------------------------------------------------------------------
def walk_by_definition(
    unary, candidates, proj, anchors, pred_codebook, succ_codebook, temperature, u, greedy
):
    """The walk, one request and one slot at a time (dflash2.md §3)."""
    cand, pred, succ = candidates, pred_codebook, succ_codebook
    n, g, k = cand.shape
    picks = torch.zeros(n, g, dtype=torch.long)
    qs = torch.zeros(n, g, k)
    for r in range(n):
        prev = int(anchors[r])
        for j in range(g):
            score = torch.tensor([float(unary[r, j, c]) + float((pred[prev] * proj[r, j] * succ[cand[r, j, c]]).sum())
                                  for c in range(k)])  # fmt: skip
            if greedy[r]:
                pick = int(score.argmax())
                qs[r, j, pick] = 1.0
            else:
                q = torch.softmax(score / float(temperature[r]), -1)
                cdf = q.cumsum(0)
                pick = int((cdf < float(u[r, j]) * float(cdf[-1])).sum().clamp(max=k - 1))
                qs[r, j] = q
            picks[r, j] = pick
            prev = int(cand[r, j, pick])
    return picks, qs


def walk_inputs(n=5, g=4, k=6, rank=7, vocab=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, g, vocab, generator=gen) * 2
    unary, cand = top_candidates(logits, k)
    return dict(
        unary=unary, candidates=cand, proj=torch.randn(n, g, rank, generator=gen),
        anchors=torch.randint(0, vocab, (n,), generator=gen), pred_codebook=torch.randn(vocab, rank, generator=gen),
        succ_codebook=torch.randn(vocab, rank, generator=gen),
        temperature=torch.tensor([0.0, 1.0, 0.7, 1.3, 0.5])[:n], u=torch.rand(n, g, generator=gen),
        greedy=torch.tensor([True, False, False, True, False])[:n],
    )  # fmt: skip


def test_walk_matches_its_definition_and_is_batch_independent():
    args = walk_inputs()
    picks, q = selector_walk(**args)
    want_p, want_q = walk_by_definition(**args)
    assert torch.equal(picks, want_p)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-6)
    for r in range(5):  # a request's walk does not depend on the rest of the batch
        one = {
            k: v[r : r + 1] if v.dim() and k not in ("pred_codebook", "succ_codebook") else v
            for k, v in args.items()
        }
        p1, q1 = selector_walk(**one)
        assert torch.equal(p1[0], picks[r]) and torch.equal(q1[0], q[r])
    assert (q.sum(-1) - 1).abs().max() < 1e-5
    # every row greedy: any_sampled=False skips the draws and gives the same walk
    greedy_args = {**args, "greedy": torch.ones(5, dtype=torch.bool)}
    p_all, q_all = selector_walk(**greedy_args)
    p_fast, q_fast = selector_walk(**greedy_args, any_sampled=False)
    assert torch.equal(p_all, p_fast) and torch.equal(q_all, q_fast)


def test_sampled_picks_follow_q():
    """Over many seeds a slot's pick is distributed as its q (the walk's sampling is exact)."""
    n, vocab = 20000, 30
    args = walk_inputs(n=1, g=1, k=5, vocab=vocab, seed=3)
    big = {k: (v.expand(n, *v.shape[1:]).contiguous() if v.dim() and k not in ("pred_codebook", "succ_codebook") else v)
           for k, v in args.items()}  # fmt: skip
    big["greedy"] = torch.zeros(n, dtype=torch.bool)
    big["temperature"] = torch.full((n,), 0.8)
    big["u"] = uniform(torch.arange(n), torch.zeros(n, 1, dtype=torch.long), 0)
    picks, q = selector_walk(**big)
    assert chi_square_p(torch.bincount(picks[:, 0], minlength=5), q[0, 0]) > 1e-3


def test_propose_reports_drafts_candidates_and_overturns():
    drafter = make_drafter(make_target(), dflash2=True, std=0.5)
    selector = drafter.candidate_selector
    with torch.no_grad():
        selector.successor_codebook.mul_(20.0)  # a strong pair term overturns argmax picks
    gen = torch.Generator().manual_seed(1)
    hidden, logits = torch.randn(3, 5, 48, generator=gen), torch.randn(3, 5, 61, generator=gen)
    with torch.no_grad():
        prop = propose(hidden=hidden, logits=logits, anchors=torch.tensor([1, 2, 3]), selector=selector,
                       temperature=torch.zeros(3), greedy=torch.ones(3, dtype=torch.bool), u=torch.rand(3, 5))  # fmt: skip
    assert prop.drafts.shape == (3, 5) and prop.candidates.shape == prop.cand_probs.shape == (3, 5, 4)
    assert torch.equal(prop.drafts, prop.candidates.gather(-1, prop.picks[..., None])[..., 0])
    assert torch.equal(prop.overturned, prop.drafts != logits.argmax(-1))
    assert prop.overturned.any() and not prop.overturned.all()
    dense = prop.dense_probs(61)
    assert torch.equal(dense.gather(-1, prop.drafts[..., None])[..., 0], torch.ones(3, 5))


# --- acceptance over candidates -------------------------------------------------------------------
def test_candidate_rejection_equals_dense_rejection():
    """Same accepted lengths and emitted tokens as `rejection_accept` with q densified, bit for bit."""
    gen = torch.Generator().manual_seed(4)
    n, g, k, vocab = 400, 4, 5, 23
    _, cand = top_candidates(torch.randn(n, g, vocab, generator=gen), k)
    cq = torch.softmax(torch.randn(n, g, k, generator=gen) * 2, -1)
    cq[:7] = torch.nn.functional.one_hot(cq[:7].argmax(-1), k).float()  # greedy drafts among them
    dense = torch.zeros(n, g, vocab).scatter_(-1, cand, cq)
    # p near q, so that every accepted length occurs
    p = torch.softmax(torch.randn(n, g + 1, vocab, generator=gen) * 2, -1) * 0.2
    p[:, :g] += 0.8 * dense
    p[:, g] /= 0.2
    picks = torch.multinomial(cq.view(-1, k), 1, generator=gen).view(n, g)
    drafts = cand.gather(-1, picks[..., None])[..., 0]
    seeds = torch.arange(n)
    ua, ue = (
        uniform(seeds, torch.arange(g)[None].expand(n, g), 1),
        uniform(seeds, torch.arange(g + 1)[None].expand(n, g + 1), 2),
    )
    valid = torch.ones(n, g, dtype=torch.bool)
    valid[:20, 2:] = False
    got = rejection_accept_candidates(drafts, cand, cq, p, ua, ue, valid)
    want = rejection_accept(drafts, dense, p, ua, ue, valid)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert set(got[0].tolist()) == set(range(g + 1))  # every length occurs


@pytest.mark.parametrize("g", [1, 3])
def test_candidate_rejection_emits_exactly_p(g):
    """Whatever q over the candidates is, the first token is distributed as p_1 (and the second as p_2
    given the first draft was accepted); acceptance of slot 1 is sum_x min(p, q)."""
    n, vocab, k = 60000, 7, 3
    gen = torch.Generator().manual_seed(g)
    p = torch.softmax(torch.randn(g + 1, vocab, generator=gen) * 1.5, -1)
    cand = torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in range(g)])  # [g, K]
    cq = torch.softmax(torch.randn(g, k, generator=gen) * 1.5, -1)
    seeds = torch.arange(n)
    pos = torch.arange(1, g + 1)[None].expand(n, g)
    u_draft = uniform(seeds, pos, 0)
    picks = torch.stack(
        [(cq[j].cumsum(0)[None] < u_draft[:, j : j + 1]).sum(-1).clamp(max=k - 1) for j in range(g)], 1
    )
    drafts = cand[torch.arange(g)[None], picks]
    acc, emit = rejection_accept_candidates(
        drafts, cand[None].expand(n, g, k), cq[None].expand(n, g, k), p[None].expand(n, g + 1, vocab),
        uniform(seeds, pos, PURPOSE_ACCEPT), uniform(seeds, torch.arange(1, g + 2)[None].expand(n, g + 1), PURPOSE_EMIT),
    )  # fmt: skip
    first = torch.where(acc > 0, drafts[:, 0], emit)
    assert chi_square_p(torch.bincount(first, minlength=vocab), p[0]) > 1e-3
    q0 = torch.zeros(vocab).scatter_(0, cand[0], cq[0])
    assert abs(float((acc > 0).double().mean()) - float(torch.minimum(p[0], q0).sum())) < 0.01
    if g > 1:
        sel = acc > 0
        second = torch.where(acc[sel] > 1, drafts[sel, 1], emit[sel])
        assert chi_square_p(torch.bincount(second, minlength=vocab), p[1]) > 1e-3


# --- the reference loop ------------------------------------------------------------------------------
def strong_selector(drafter: DFlash2Drafter, scale: float = 8.0) -> DFlash2Drafter:
    with torch.no_grad():
        drafter.candidate_selector.successor_codebook.mul_(scale)
    return drafter


@pytest.mark.parametrize(("variant", "block"), [("plain", 4), ("swa", 6), ("gpt_oss", 5)])
def test_greedy_equals_plain_decoding(variant, block):
    arch = "gpt_oss" if variant == "gpt_oss" else "qwen3"
    target = make_target(arch, seed=7, vocab=13)
    drafter = strong_selector(make_drafter(target, variant=variant, dflash2=True, block_size=block, std=0.5))
    adapter = HFTarget(target)
    overturned = accepted = 0
    for prompt in ([1, 2, 3], [5, 9, 2, 7, 1, 1, 4], [11]):
        spec = spec_generate(adapter, drafter, prompt, max_new_tokens=40)
        plain = spec_generate(adapter, None, prompt, max_new_tokens=40)
        assert spec.output_ids == plain.output_ids
        overturned += spec.num_overturned
        accepted += spec.num_accepted_draft_tokens
    assert overturned > 0 and accepted > 0, (overturned, accepted)


def test_ddtree_with_a_dflash2_drafter_is_refused_by_name():
    """A DDTree built from the drafter's marginals would bypass the selector: refused, never a fallback."""
    target = make_target()
    adapter = HFTarget(target)
    with pytest.raises(ConfigError, match=r"tree_budget=8: DDTree verification does not run DFlash 2") as err:
        spec_generate(adapter, make_drafter(target, dflash2=True), [1, 2, 3], max_new_tokens=4, tree_budget=8)
    assert err.value.field == "tree_budget" and "set tree_budget 0" in str(err.value)
    v1 = spec_generate(adapter, make_drafter(target), [1, 2, 3], max_new_tokens=4, tree_budget=8)
    assert v1.output_ids == spec_generate(adapter, None, [1, 2, 3], max_new_tokens=4).output_ids


# The sampling modes the chi-square tests cover (here for the loop, in tests/engine for the engine).
SAMPLING_CASES = pytest.mark.parametrize(
    "sampling",
    [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_k=3, greedy_draft=True),
     SamplingConfig(temperature=1.3, top_p=0.85)],
    ids=["sampled-draft", "greedy-draft-topk", "sampled-draft-topp"],
)  # fmt: skip


@pytest.mark.slow
@SAMPLING_CASES
def test_dflash2_sampling_preserves_target_distribution(sampling):
    """The full loop (prefill token + one round of 2 drafts from the selector) with many seeds: the
    joint distribution of the 3 generated tokens is the target's."""
    target = make_target("qwen3", seed=5, vocab=5, layers=4)
    drafter = strong_selector(
        make_drafter(target, block_size=4, std=0.6, seed=3, dflash2={"selector_top_k": 3}), 4.0
    )
    adapter = HFTarget(target)
    prompt = [1, 3, 2]
    exact = exact_joint(target, prompt, sampling, steps=3)
    counts = torch.zeros_like(exact)
    accepted = 0
    runs = 1500
    for s in range(runs):
        cfg = SamplingConfig(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                             greedy_draft=sampling.greedy_draft, seed=s)  # fmt: skip
        res = spec_generate(adapter, drafter, prompt, max_new_tokens=3, sampling=cfg)
        counts[tuple(res.output_ids)] += 1
        accepted += res.num_accepted_draft_tokens
    assert accepted / (2 * runs) > 0.05, "drafts were (almost) never accepted: the test proves little"
    assert chi_square_p(counts, exact) > 1e-3


def test_dflash2_is_a_drafter_everywhere_v1_is():
    drafter = make_drafter(make_target(), dflash2=True)
    assert isinstance(drafter, DFlashDrafter) and drafter.block_size == 4
