"""The runtime interface: gradients are the mean whether or not anyone clips, parameters stay
visible to standard code, old checkpoints load, and a stateful reducer resumes exactly."""

import gc
import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from models.config import ModelConfig
from models.transformer import Transformer, lm_loss
from tests.zeropp.test_engine import BATCH, OPTIM, _zero_run, batches, make_engine, make_model, reference, train_step
from trainer.optim import build_optimizer
from trainer.spawn import run_ranks
from zeropp.config import GradientCompression, ZeroConfig
from zeropp.ddp import DDPRuntime

FP32 = ZeroConfig(stage=3, communication_data_type="fp32")
V1 = Path(__file__).parent / "data" / "checkpoint_v1"


def test_no_clipping_is_the_same_update_as_an_infinite_clip_norm():
    """Without any clip call the optimizer sees the mean gradient (the divide lives in the reduce):
    2 ranks x 2 micro-batches, no clipping at all, equal the reference clipped at infinity."""
    ref_losses, ref_state = reference("gpt2-tiny", 4, clip=float("inf"))
    losses, state, _ = run_ranks(_zero_run, 2, args=("gpt2-tiny", 4, 2, 2, None))[0]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5
    assert max((state[k] - ref_state[k]).abs().max().item() for k in state) < 1e-5


def _standard_tools(rank, world):
    engine, optimizer = make_engine(make_model("llama-tiny"), FP32)
    params = dict(engine.module.named_parameters())
    ema = {name: p.detach().clone() for name, p in params.items() if p.requires_grad}
    norms = []
    for sample in batches(4):
        per_rank = BATCH // world
        mine = sample[rank * per_rank:(rank + 1) * per_rank]
        engine.backward(lm_loss(engine(mine[:, :-1]), mine[:, 1:]))
        norms.append(engine.clip_grad_norm_(0.5).item())
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():  # an EMA of the trainable parameters, the standard way
            for name, e in ema.items():
                e.lerp_(params[name], 0.1)
    local_shapes = {name: tuple(p.shape) for name, p in params.items()}
    full_ema = engine.unshard(ema)
    state = engine.full_state_dict()
    engine.close()
    return len(params), local_shapes, norms, full_ema, state


def test_parameters_stay_visible_clipping_and_an_ema_work_with_standard_code():
    """After wrapping, model.parameters() yields this rank's shards (every parameter once, 1-D
    pieces that partition it); the runtime's clip_grad_norm_ returns the global norm of the
    reference and clips like torch's; an EMA kept with plain tensor code over the shards equals
    the reference's EMA of the full parameters."""
    model = make_model("llama-tiny")
    ref_params = dict(model.named_parameters())
    ema = {name: p.detach().clone() for name, p in ref_params.items()}
    opt = build_optimizer(model, OPTIM)
    ref_norms = []
    for sample in batches(4):
        lm_loss(model(sample[:, :-1]), sample[:, 1:]).backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for name, e in ema.items():
                e.lerp_(ref_params[name], 0.1)

    results = run_ranks(_standard_tools, 2)
    for n_params, shapes, norms, full_ema, state in results:
        assert n_params == len(ref_params)
        for name, p in ref_params.items():
            assert len(shapes[name]) == 1
        assert sum(s[0] for r in results for name, s in r[1].items()) == sum(p.numel() for p in ref_params.values())
        assert max(abs(a - b) / b for a, b in zip(norms, ref_norms)) < 1e-5, (norms, ref_norms)
        assert full_ema.keys() == ema.keys()
        assert max((full_ema[k] - ema[k]).abs().max().item() for k in ema) < 1e-5
        assert max((state[k] - ref_params[k]).abs().max().item() for k in ref_params) < 1e-5


def _v1_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.from_preset("llama-tiny", vocab_size=32, n_layer=2, d_model=16, n_head=2,
                                               n_kv_head=1, d_ff=24, max_seq_len=16))


BIG_VOCAB = 16384  # gpt2-tiny's tied embedding becomes one 1M-element tensor


def _big_vocab_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig.from_preset("gpt2-tiny", vocab_size=BIG_VOCAB))


def _clipped_run(rank, world, steps, clip):
    """`steps` steps clipped at `clip`: one process on the DDP runtime (the trainer's one-process
    path), more ranks on ZeRO-3; the losses, norms and (rank 0) the full weights."""
    model = _big_vocab_model()
    runtime = DDPRuntime(model) if world == 1 else make_engine(model, FP32)[0]
    optimizer = build_optimizer(runtime.module, OPTIM)
    losses, norms = [], []
    for sample in batches(steps, BIG_VOCAB):
        mine = sample[rank * BATCH // world:(rank + 1) * BATCH // world]
        loss = lm_loss(runtime(mine[:, :-1]), mine[:, 1:])
        runtime.backward(loss)
        if world == 1:  # the norm an fp64 reduction of every gradient element gives
            exact = torch.cat([p.grad.double().reshape(-1) for p in runtime.module.parameters()]).norm().item()
        norms.append(runtime.clip_grad_norm_(clip).item())
        if world == 1:
            assert abs(norms[-1] - exact) <= 1e-6 * exact, (norms[-1], exact)
        optimizer.step()
        optimizer.zero_grad()
        t = loss.detach().clone()
        if world > 1:
            dist.all_reduce(t)
        losses.append(t.item() / world)
    state = runtime.full_state_dict()
    runtime.close()
    return losses, norms, state


def test_one_process_and_zero3_clip_with_the_same_norm():
    """Every runtime clips by the fp64 global norm: with clipping active on every step of a model
    holding a 1M-element tensor, one process (DDP runtime) and ZeRO-3 on 2 ranks stay within 1e-5
    for 20 steps (torch's fp32 clip_grad_norm_ in the one-process run drifted 5e-5 apart)."""
    steps, clip = 20, 0.05
    losses, norms, state = _clipped_run(0, 1, steps, clip)
    assert min(norms) > clip  # the clip acts on every step
    z_losses, z_norms, z_state = run_ranks(_clipped_run, 2, args=(steps, clip))[0]
    assert max(abs(a - b) for a, b in zip(losses, z_losses)) < 1e-5, (losses[-3:], z_losses[-3:])
    assert max(abs(a - b) / a for a, b in zip(norms, z_norms)) < 1e-5
    assert max((state[k] - z_state[k]).abs().max().item() for k in state) < 1e-5


def _continue_v1(rank, world):
    optim = OPTIM.__class__(lr=1e-2, weight_decay=0.1, warmup_steps=0, decay="constant", eps=1e-6)
    engine = make_engine(_v1_model(), FP32)[0]
    optimizer = build_optimizer(engine.module, optim)
    engine.load(V1 / "checkpoint", optimizer)
    data = torch.randint(0, 32, (6, 4, 9), generator=torch.Generator().manual_seed(3))
    losses = []
    for sample in data[3:]:
        mine = sample[rank * 2:(rank + 1) * 2]
        loss = lm_loss(engine(mine[:, :-1]), mine[:, 1:])
        engine.backward(loss)
        engine.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    state = engine.full_state_dict()
    engine.close()
    return losses, state


def test_a_checkpoint_written_before_the_runtime_interface_still_loads():
    """tests/zeropp/data/checkpoint_v1 was written by the engine before this interface (commit
    9e330f3: units laid out decayed-first, two optimizer pieces per shard), 3 steps into a run on
    2 ranks, with the losses and weights of the 3 steps that run took next: resuming from it now
    continues the same run."""
    expected = json.loads((V1 / "expected.json").read_text())["losses_after_resume"]
    weights = load_file(str(V1 / "expected_weights.safetensors"))
    losses, state = run_ranks(_continue_v1, 2)[0]
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-6, (losses, expected)
    assert max((state[k] - weights[k]).abs().max().item() for k in weights) < 1e-5


QGZ_EF = ZeroConfig(stage=3, communication_data_type="fp32", zero_quantized_gradients=True,
                    zero_quantized_gradients_bits=4, zero_quantization_block_size=64,
                    zero_quantized_gradients_error_feedback=True, zero_quantized_gradients_error_beta=0.8,
                    zero_quantized_gradients_error_reset=3)


def _error_feedback_resume(rank, world, directory, config):
    engine, optimizer = make_engine(make_model("gpt2-tiny"), config, ranks_per_node=2)
    data = batches(8)
    losses = [train_step(engine, optimizer, sample, rank, world) for sample in data[:4]]
    if rank == 0:
        directory.mkdir()
    dist.barrier()
    engine.save(directory, optimizer)
    dist.barrier()
    errors = {k: v.clone() for k, v in engine.reducer.state_dict().items()}
    later = [train_step(engine, optimizer, sample, rank, world) for sample in data[4:]]
    engine.close()
    resumed, resumed_optimizer = make_engine(make_model("gpt2-tiny"), config, ranks_per_node=2)
    resumed.load(directory, resumed_optimizer)
    reloaded = {k: v.clone() for k, v in resumed.reducer.state_dict().items()}
    again = [train_step(resumed, resumed_optimizer, sample, rank, world) for sample in data[4:]]
    resumed.close()
    return losses + later, again, errors, reloaded


def test_qgz_error_feedback_state_survives_a_resume_exactly(tmp_path):
    """qgZ int4 with LoCo's error feedback (beta 0.8, a reset every 3 rounds) on 2 nodes x 2: both hops'
    per-rank errors and round counters are saved with the checkpoint and reloaded bit for bit, so the
    resumed run (which crosses a reset) repeats the original's losses exactly; int4 training stays on
    the fp32 reference's curve."""
    ref_losses, _ = reference("gpt2-tiny", 8)
    results = run_ranks(_error_feedback_resume, 4, args=(tmp_path / "ckpt", QGZ_EF), ranks_per_node=2)
    for losses, again, errors, reloaded in results:
        assert again == losses[4:]
        assert errors.keys() == reloaded.keys() and errors
        assert {k.rpartition(".")[2] for k in errors} == {"error", "round"} and any("/across0." in k for k in errors)
        assert all(torch.equal(errors[k], reloaded[k]) for k in errors)
        assert any(e.abs().max() > 0 for e in errors.values())
        assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) < 0.01


def _gloo_threads() -> int:
    """This process's gloo transport threads (Linux): each live process group keeps its own."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text())
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return sum("gloo" in name for name in names)


def _runtimes_closed_one_after_another(rank, world):
    from zeropp import TensorParallelConfig, build_runtime

    after = []
    for zero, tp in 2 * [(ZeroConfig(stage=3, zero_hpz_partition_size=0, zero_quantized_gradients=True), 1),
                         (ZeroConfig(stage=0, gradient_compression=GradientCompression(method="powersgd")), 1),
                         (ZeroConfig(stage=3), 2)]:
        runtime = build_runtime(make_model("gpt2-tiny"), zero, torch.device("cpu"), TensorParallelConfig(size=tp))
        batch = batches(1)[0]
        runtime.backward(getattr(runtime, "lm_loss", lm_loss)(runtime(batch[:, :-1]), batch[:, 1:]))
        runtime.close()
        del runtime
        gc.collect()  # the runtime's reference cycles (hooks) hold the last references to its groups
        after.append((len(dist.distributed_c10d._world.pg_map), _gloo_threads()))
    return after


def test_a_closed_runtime_leaves_no_process_group_behind():
    """A process that builds runtimes one after another (tests, benchmarks, RLHF stages) ends each
    with the process groups and gloo threads it had before: ZeRO++ (hpZ's and the communication
    thread's groups), DDP with PowerSGD's group, a tensor-parallel runtime's TP x DP mesh, each built
    twice: the second round leaves exactly what the first did (the default group's own threads start
    with its first collectives)."""
    for after in run_ranks(_runtimes_closed_one_after_another, 4, ranks_per_node=2):
        assert after[3:] == after[:3] and {groups for groups, _ in after} == {1}
