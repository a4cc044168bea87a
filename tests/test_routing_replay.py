"""Routing replay (docs/moe.md): the torch engine records the experts each token ran
through, they travel with the trajectory and are checked on receipt, and the learner
compares them with its own picks and, replaying, routes as the engine did."""

import pytest
import torch

from asyncfp8.moe import RouterTap, moe_layout
from asyncfp8.moe.routes import NO_ROUTE, pack_routes, routes_of
from asyncfp8.report.summary import per_step
from asyncfp8.sync import Trajectory
from asyncfp8.sync.limits import Limits, RejectedMessage
from tests.launched import launch


def own_routes(model, ids: list[int]) -> torch.Tensor:
    """[tokens, layers, top_k]: the experts `model`'s routers pick for `ids` in one forward."""
    tap = RouterTap(model)
    with torch.no_grad(), tap.reading() as routes:
        model(input_ids=torch.tensor([ids], device=model.get_input_embeddings().weight.device))
    return torch.stack(routes.chosen, 1)


def same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.long().sort(-1).values == b.long().sort(-1).values).all(-1)


def assert_routes_recorded(engine) -> None:
    """Prompt tokens from the fill, completion tokens from the step that fed them, the
    last (never fed) without: they agree with a whole-sequence forward of the engine's own
    model (FP32: the fill and the steps sum in another order, so a near-tie may flip; an
    off-by-one column would agree on about 1 pair in 6). A second call of the same shapes
    compiles nothing more and records the same routes."""
    from asyncfp8.engines.base import SamplingParams

    layout = moe_layout(engine.model.config)
    prompts = ["1+2=", "12+345=", "7*8="]  # uneven lengths: left padding in the fill
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=0)
    samples = engine.generate(prompts, sampling)  # 6 requests through 3 slots: refills
    agree = total = 0
    for sample in samples:
        ids = sample.prompt_ids + sample.token_ids
        routes = routes_of(sample.routes, len(ids), layout, "sample")
        assert (routes[-1] == NO_ROUTE).all()  # the last token was never fed
        assert (routes[:-1] != NO_ROUTE).all()
        full = own_routes(engine.model, ids)
        agree += int(same_sets(routes[:-1].cpu(), full[:-1].cpu()).sum())
        total += (len(ids) - 1) * len(layout.layers)
    assert agree / total >= 0.97, (agree, total)
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    again = engine.generate(prompts, sampling)
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames
    assert [s.routes for s in again] == [s.routes for s in samples]


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_the_torch_engine_records_the_routes_each_token_ran(tiny_moe_dir, compiled):
    """Eager, or compiled: the compiled step writes them from inside its graph, as a
    captured CUDA graph does (no Python hook runs there)."""
    from asyncfp8.engines.torch_engine import TorchEngine

    engine = TorchEngine(str(tiny_moe_dir), "bf16", dtype=torch.float32, slots=3, compile=compiled)
    assert_routes_recorded(engine)
    assert engine._slot_decoder.compiled == compiled  # a failed compile would run eager


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_a_captured_compiled_step_records_the_routes_each_token_ran(tiny_moe_dir):
    from asyncfp8.engines.torch_engine import TorchEngine

    engine = TorchEngine(
        str(tiny_moe_dir), "bf16", dtype=torch.float32, slots=3, device="cuda", compile=True
    )
    assert_routes_recorded(engine)
    decoder = engine._slot_decoder
    assert decoder.use_graph and decoder.compiled and decoder._graph is not None


def test_routes_travel_with_a_trajectory_and_a_wrong_length_is_refused():
    routes = pack_routes(torch.randint(0, 4, (5, 2, 2)))
    trajectory = Trajectory([1, 2], [3, 4, 5], [-0.1] * 3, [0] * 3, 1.0, "g", seq=0, routes=routes)
    _, back = Trajectory.decode(trajectory.encode("w/1"), Limits())
    assert back.routes == routes
    _, none = Trajectory.decode(
        Trajectory([1], [2], [-0.1], [0], 1.0, "g", seq=0).encode("w/1"), Limits()
    )
    assert none.routes is None
    trajectory.routes = routes[:-1]  # 19 bytes for 5 tokens
    with pytest.raises(RejectedMessage, match="no whole number per token of its 5 tokens"):
        Trajectory.decode(trajectory.encode("w/1"), Limits())


def test_routes_that_do_not_fit_the_model_are_named_and_never_trained_on():
    from asyncfp8.learner.inbox import Inbox
    from asyncfp8.learner.leases import LeaseBook
    from asyncfp8.moe import MoELayout

    layout = MoELayout(experts=4, top_k=2, layers=(0, 1))
    with pytest.raises(ValueError, match="sample 7: 9 bytes of routes for 3 tokens, but the "):
        routes_of(bytes(9), 3, layout, "sample 7")
    with pytest.raises(ValueError, match="sample 7: routes name expert 9 of a model of 4"):
        routes_of(bytes([9] + [0] * 11), 3, layout, "sample 7")
    inbox = Inbox(None, LeaseBook(capacity=4, timeout=60), 1, {}, 0, None)
    inbox.route_layout, inbox.version = layout, 0
    lease = inbox.lease("w", 1, {})["lease"]
    prompt = inbox.book.leases[lease].pending
    bad = Trajectory([1], [2, 3], [-0.1] * 2, [0] * 2, 1.0, "g", seq=4, worker_id="w")
    bad.prompt_index, bad.meta = min(prompt), {"lease": lease}
    bad.routes = bytes(3 * 3)  # three layers' worth
    inbox.deliver([bad])
    assert inbox.counts["bad_trajectories"] == 1 and inbox.ready_groups() == 0
    bad.routes = bytes(3 * 4)
    inbox.deliver([bad])
    assert inbox.ready_groups() == 1  # the group of one is ready


def test_replaying_the_learners_own_routes_changes_nothing_and_others_are_used(tiny_moe_dir):
    """The replay hook with the learner's own routes leaves the forward as it was (and
    counts no mismatch); with other experts it routes through them, weighted by the
    learner's own router probabilities renormalized over them, and the router still
    gets a gradient."""
    from asyncfp8.hf.loading import load_model

    model = load_model(tiny_moe_dir, dtype=torch.float32)
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    tap = RouterTap(model)
    with tap.reading() as plain:
        reference = model(input_ids=ids).logits
    own = torch.stack(plain.chosen, 1).reshape(2, 6, 2, 2).to(torch.uint8)
    with tap.routed(own, replay=True), tap.reading():
        again = model(input_ids=ids).logits
    assert torch.equal(again, reference)
    assert tap.take_counts() == (24, 0, 12)  # 12 tokens × 2 layers compared; 12 replayed
    forced = torch.zeros_like(own)
    forced[..., 1] = 3  # experts {0, 3} for every token, every layer
    forced[1, 5] = NO_ROUTE  # one token without a route: the learner's own
    model.zero_grad()
    with tap.routed(forced, replay=True), tap.reading() as routes:
        replayed = model(input_ids=ids).logits
        replayed.pow(2).mean().backward()
    chosen = torch.stack(routes.chosen, 1).reshape(2, 6, 2, 2)
    assert (chosen[0] == forced[0].long()).all()
    # The token without a route takes its own router's picks in this forward (in layer 1
    # they may differ from the plain forward's: the tokens it attends to were rerouted).
    for layer, logits in enumerate(routes.logits):
        own_pick = logits[11].detach().topk(2).indices.sort().values
        assert torch.equal(chosen[1, 5, layer].sort().values, own_pick), layer
    assert not torch.allclose(replayed, reference)
    assert tap.take_counts()[0] == 22  # 11 tokens with routes × 2 layers
    # Compared without replay: the mismatch is against the learner's own forward.
    with torch.no_grad(), tap.routed(forced, replay=False), tap.reading():
        assert torch.equal(model(input_ids=ids).logits, reference)
    expected = ~same_sets(own.reshape(-1, 2, 2)[:-1], forced.reshape(-1, 2, 2)[:-1])
    assert tap.take_counts() == (22, int(expected.sum()), 0)
    assert model.model.layers[0].mlp.gate.weight.grad.abs().max() > 0
    # The gate weights: the learner's own probabilities of the replayed experts, renormalized.
    probs = routes.logits[0].softmax(-1)[0]
    weights = probs[[0, 3]] / probs[[0, 3]].sum()
    hidden = {}
    hook = model.model.layers[0].mlp.experts.register_forward_hook(
        lambda module, args, out: hidden.update(args=args)  # None: the output stays
    )
    with torch.no_grad(), tap.routed(forced, replay=True):
        model(input_ids=ids)
    hook.remove()
    _, indices, scores = hidden["args"]
    assert indices[0].tolist() == [0, 3]
    torch.testing.assert_close(scores[0], weights.to(scores.dtype))


@pytest.mark.slow
def test_a_replayed_run_reports_its_routing_and_a_worker_sends_routes(tmp_path, tiny_moe_dir):
    """Through the launcher with a worker process: the routes cross the socket, fit, and
    every trained sample's tokens are replayed; the mismatch is a share."""
    run_dir, _ = launch(
        tmp_path,
        tiny_moe_dir,
        "run.steps=3",
        "run.placement=separate",
        "run.workers=1",
        "correction.routing_replay=true",
    )
    done = per_step(run_dir)
    assert [r["step"] for r in done] == [1, 2, 3]
    for record in done:
        assert 0 <= record["moe/routing_mismatch"] <= 1
        assert record["moe/replayed_tokens"] > 0
        assert record["total/bad_trajectories"] == 0


def test_routes_of_groups_held_at_a_checkpoint_survive_the_resume(tmp_path):
    """A checkpoint saves the inbox's partial and ready groups with their routes (the
    learner's state, torch.save) and a resumed learner trains on them as they were."""
    from asyncfp8.learner.inbox import Inbox
    from asyncfp8.learner.leases import LeaseBook
    from asyncfp8.moe import MoELayout

    layout = MoELayout(experts=4, top_k=2, layers=(0, 1))
    inbox = Inbox(None, LeaseBook(capacity=4, timeout=60), 2, {}, 0, None)
    inbox.route_layout, inbox.version = layout, 0
    lease = inbox.lease("w", 1, {})["lease"]
    prompt = min(inbox.book.leases[lease].pending)
    routes = pack_routes(torch.randint(0, 4, (3, 2, 2)))
    sample = Trajectory([1], [2, 3], [-0.1] * 2, [0] * 2, 1.0, "g", seq=0, routes=routes)
    sample.prompt_index, sample.meta = prompt, {"lease": lease}
    inbox.deliver([sample])  # one of a group of two: partial
    torch.save(inbox.state_dict(), tmp_path / "state.pt")
    resumed = Inbox(None, LeaseBook(capacity=4, timeout=60), 2, {}, 0, None)
    resumed.route_layout = layout
    resumed.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=False))
    [kept] = resumed.partial[(lease, prompt)]
    assert kept.routes == routes
