"""The C++ kernels of a training forward and backward (`Rope`, `NormRows`, `token_logprobs`):
the same values as the PyTorch operations they replace, and the gradients of a model trained
through them as close to fp32's as PyTorch's own bf16 ones."""

import pytest
import torch

from agent_runtime.model import fast_decode, load_model
from agent_runtime.model import model as mm
from tiny_checkpoints import VOCAB, save_hf_checkpoint


def _relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("B,T,N,D", [(2, 37, 6, 64), (1, 5, 3, 32), (3, 11, 2, 20)])
def test_rope_with_a_gradient_is_autograds_rope_bit_for_bit(built, B, T, N, D):
    """`Rope` (the rotary embedding of a training forward) against the bf16 formula it
    replaces, forward and backward: the same bits, in the 16-lane loop (D / 2 % 16 == 0) and
    the scalar one (D = 20)."""
    g = torch.Generator().manual_seed(D)
    x = (3 * torch.randn(B, T, N, D, generator=g)).bfloat16()
    angles = torch.randn(B, 1, T, D // 2, generator=g)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    grad = torch.randn(B, N, T, D, generator=g).bfloat16()

    ref_x = x.clone().requires_grad_()
    qk = ref_x.transpose(1, 2)
    ref = qk * cos + mm.rotate_half(qk) * sin
    ref.backward(grad)
    ours_x = x.clone().requires_grad_()
    ours = mm.Rope.apply(ours_x, cos, sin)
    ours.backward(grad)
    assert ours.shape == ref.shape and torch.equal(ours, ref)
    assert torch.equal(ours_x.grad, ref_x.grad)


@pytest.mark.parametrize("shape,weights", [((2, 37, 6, 64), 6), ((3, 300, 256), 1),
                                           ((5, 20), 1), ((50, 7, 24), 7)])
def test_rmsnorm_with_a_gradient_is_rmsnorm_and_its_backward(built, shape, weights):
    """`NormRows` (RMSNorm of a training forward) gives `rms_norm_rows`' bits forward (the
    inference path's), and its gradients of x and of the weight (one row, or a row per head:
    row i of x takes weight row i % W) land within 1 % of float64 autograd, at most twice as
    far as PyTorch's bf16 autograd plus 0.1 % (the scalar loop too: widths 20 and 24)."""
    H = shape[-1]
    g = torch.Generator().manual_seed(H)
    x = (2 * torch.randn(*shape, generator=g)).bfloat16()
    w = (torch.rand(weights, H, generator=g) + 0.5).bfloat16()
    w = w[0] if weights == 1 else w
    grad = torch.randn(*shape, generator=g).bfloat16()

    def run(fn, dtype):
        leaves = [t.to(dtype).clone().requires_grad_() for t in (x, w)]
        out = fn(*leaves)
        out.backward(grad.to(dtype))
        return [out.detach()] + [t.grad for t in leaves]

    python = lambda x, w: w * mm.rms_normalize(x, 1e-6)
    exact = run(python, torch.float64)
    theirs = run(python, torch.bfloat16)
    ours = run(lambda x, w: mm.NormRows.apply(x, w, 1e-6), torch.bfloat16)
    assert torch.equal(ours[0], fast_decode.extension().rms_norm_rows(x, w, 1e-6))
    for mine, bf16, ref in zip(ours[1:], theirs[1:], exact[1:]):
        assert mine.dtype == torch.bfloat16 and mine.shape == ref.shape
        assert _relative(mine, ref) < min(0.01, 2 * _relative(bf16, ref) + 1e-3)


def test_the_weight_gradient_does_not_depend_on_the_thread_count(built):
    """The weight's gradient sums fixed blocks of rows in a fixed order: one thread and two
    give the same bits (a resumed run may get another thread count than the run it resumes)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, 64, generator=g).bfloat16()
    w = (torch.rand(6, 64, generator=g) + 0.5).bfloat16()
    grad = torch.randn(3000, 64, generator=g).bfloat16()
    ext = fast_decode.extension()
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(ext.rms_norm_rows_backward(grad, x, w, 1e-6))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N,V", [(37, 8192), (5, 1000), (3, 17)])
def test_token_logprobs_are_log_softmax_at_the_target_and_its_gradient(built, dtype, N, V):
    """`token_logprobs` (the loss's log-probabilities: one pass over each row of logits)
    against `log_softmax(logits.float() / T).gather(target)` in float64, with a temperature
    per row: the values within 1e-5, the logits' gradient within 2^-16 of its size plus 1e-6
    in fp32 (the exponent's rounding after dividing by T), and one ulp in bf16 (its one
    rounding)."""
    g = torch.Generator().manual_seed(V)
    logits = (4 * torch.randn(N, V, generator=g)).to(dtype)
    target = torch.randint(0, V, (N,), generator=g)
    temps = torch.rand(N, generator=g) + 0.3
    weight = torch.randn(N, generator=g)

    exact_in = logits.double().requires_grad_()
    exact = (exact_in / temps.double()[:, None]).log_softmax(-1).gather(-1, target[:, None])[:, 0]
    (exact * weight.double()).sum().backward()
    ours_in = logits.clone().requires_grad_()
    ours = mm.token_logprobs(ours_in, target, temps)
    (ours * weight).sum().backward()
    assert ours.dtype == torch.float32 and ours.shape == (N,)
    assert float((ours.detach().double() - exact.detach()).abs().max()) < 1e-5
    assert ours_in.grad.dtype == dtype
    ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -16
    bound = ulp * exact_in.grad.abs() + 1e-6
    assert bool(((ours_in.grad.double() - exact_in.grad).abs() <= bound).all())


def test_token_logprobs_refuse_a_target_out_of_range(built):
    with pytest.raises(RuntimeError, match="target id out of range"):
        mm.token_logprobs(torch.randn(2, 10), torch.tensor([3, 10]), 1.0)


def test_a_bf16_model_trains_through_the_training_kernels(built, tmp_path, monkeypatch):
    """A bf16 model's training gradients go through `Rope`, `NormRows` and `token_logprobs`'
    kernel where they serve (`TRAIN_KERNELS`), and land as close to the fp32 model's as
    PyTorch's operations take them."""
    path = save_hf_checkpoint("qwen3_moe", tmp_path / "m", head_dim=32)
    ids = torch.randint(0, VOCAB, (2, 90), generator=torch.Generator().manual_seed(0))
    calls = {mm.Rope: 0, mm.NormRows: 0, mm.TokenLogprobs: 0}
    for fn in calls:
        apply = fn.apply
        monkeypatch.setattr(fn, "apply", lambda *a, apply=apply, fn=fn: calls.__setitem__(
            fn, calls[fn] + 1) or apply(*a))

    def grads(dtype, kernels):
        monkeypatch.setattr(mm, "TRAIN_KERNELS", kernels)
        model = load_model(path, dtype=dtype)
        logits = model(ids).logits[:, :-1]
        lp = mm.token_logprobs(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        lp.mean().backward()
        return torch.cat([p.grad.double().flatten() for p in model.parameters()])

    exact = grads("float32", False)
    pytorch = grads("bfloat16", False)
    assert set(calls.values()) == {0}
    ours = grads("bfloat16", True)
    layers = load_model(path).args.num_layers
    assert calls[mm.Rope] == layers and calls[mm.NormRows] >= 2 * layers + 1
    assert calls[mm.TokenLogprobs] == 1
    assert _relative(ours, exact) < 2 * _relative(pytorch, exact) + 1e-3
