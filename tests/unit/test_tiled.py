"""TiledMLP and TiledLoss in one process: the tiled functions equal the untiled ones, values and gradients."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_fpdt.callbacks.tiled_loss import TiledLoss
from lightning_fpdt.callbacks.tiled_mlp import TiledMLP
from lightning_fpdt.integrations import apply_tiled_loss
from lightning_fpdt.memory import (
    apply_tiled_mlp,
    auto_loss_tiles,
    auto_mlp_tiles,
    tile_bounds,
    tiled_cross_entropy,
    tiled_mlp,
)
from lightning_fpdt.memory import tiled_loss as tiled_loss_module
from lightning_fpdt.memory.tiled_mlp import LinearGradients
from lightning_fpdt.models.llama import LlamaConfig, LlamaForCausalLM, LlamaMLP
from tests.dist.training import LitLM, TokenDataset, full_state, trainer_kwargs

# fp64: tiling only changes the order of sums (per-tile parameter gradients, fp64 accumulators): ~1e-15 relative.
FP64_TOL = dict(rtol=1e-10, atol=1e-12)
# fp32 training of a tiny model for 3 SGD steps: tiled and untiled differ by summation order (~1e-7 per op).
FP32_TOL = dict(rtol=1e-4, atol=2e-5)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def gated_mlp() -> nn.Module:
    return LlamaMLP(LlamaConfig.from_name("tiny", hidden_size=16, intermediate_size=40)).double()


def sequential_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 16)).double()


def grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in module.named_parameters()}


# ---- TiledMLP ---------------------------------------------------------------------------------------------------
def test_tile_bounds_cover_tokens_in_order():
    """Tiles are contiguous, cover every token once, differ in length by at most one, never exceed the tokens."""
    assert tile_bounds(14, 3) == [(0, 5), (5, 10), (10, 14)]
    assert tile_bounds(4, 9) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert tile_bounds(0, 3) == [(0, 0)]


def test_auto_tiles_keep_one_tile_under_256_mib():
    """'auto': Llama-3-8B MLP at 256K tokens in bf16 needs 84 tiles; its 128K-vocab loss at 512K tokens 1002."""
    assert auto_mlp_tiles(262144, 14336, 2) == 84  # 262144 · 14336 · 3 · 2 B / 256 MiB
    assert auto_mlp_tiles(16, 128, 4) == 1
    assert auto_loss_tiles(524288, 128256) == 251  # 524288 · 128256 · 4 B / 1 GiB, rounded up
    assert auto_loss_tiles(3, 64) == 1


@pytest.mark.parametrize("make_mlp", [gated_mlp, sequential_mlp], ids=["gated", "sequential"])
@pytest.mark.parametrize("num_tiles", [1, 3, 5, 40, "auto"])
def test_tiled_mlp_matches_untiled(make_mlp, num_tiles):
    """Output, input gradient and parameter gradients of the tiled MLP equal the untiled MLP's (fp64)."""
    mlp = make_mlp()
    ref = copy.deepcopy(mlp)
    apply_tiled_mlp(mlp, num_tiles=num_tiles)
    x = torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True)  # 14 tokens: 3 and 5 do not divide them
    x_ref = x.detach().clone().requires_grad_()
    grad_out = torch.randn(2, 7, 16, dtype=torch.float64)

    out, out_ref = mlp(x), ref(x_ref)
    torch.testing.assert_close(out, out_ref, **FP64_TOL)
    out.backward(grad_out)
    out_ref.backward(grad_out)
    torch.testing.assert_close(x.grad, x_ref.grad, **FP64_TOL)
    for name, g in grads(mlp).items():
        torch.testing.assert_close(g, grads(ref)[name], **FP64_TOL, msg=lambda m: f"{name}: {m}")


def test_tiled_mlp_saves_only_its_input():
    """Autograd keeps one tensor (the input) for the tiled MLP, against every intermediate for the untiled one."""
    mlp = gated_mlp()
    ref = copy.deepcopy(mlp)
    apply_tiled_mlp(mlp, num_tiles=3)
    x = torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True)

    def saved(module: nn.Module) -> list[torch.Tensor]:
        packed: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            module(x)
        return packed

    tiled, untiled = saved(mlp), saved(ref)
    assert len(tiled) == 1 and tiled[0] is x
    assert len(untiled) > 3


def test_tiled_mlp_parameter_grads_without_input_grad():
    """An input that needs no gradient still gets the parameters theirs (the Function takes them as inputs)."""
    mlp = gated_mlp()
    ref = copy.deepcopy(mlp)
    apply_tiled_mlp(mlp, num_tiles=3)
    x = torch.randn(14, 16, dtype=torch.float64)
    grad_out = torch.randn(14, 16, dtype=torch.float64)
    mlp(x).backward(grad_out)
    ref(x).backward(grad_out)
    for name, g in grads(mlp).items():
        torch.testing.assert_close(g, grads(ref)[name], **FP64_TOL, msg=lambda m: f"{name}: {m}")


def bf16_gradient_errors(ref: nn.Module, width: int, linears_of=lambda mlp: ()) -> dict[int, float]:
    """The worst relative error against fp64 of a bf16 copy of ``ref``'s parameter gradients, untiled (1) and over 64
    tiles, ``linears_of(mlp)`` the layers whose gradients the matmul path sums."""
    x = torch.randn(4096, width, dtype=torch.float64)
    grad_out = torch.randn(4096, width, dtype=torch.float64)
    ref(x).backward(grad_out)
    errors = {}
    for num_tiles in (1, 64):
        mlp = copy.deepcopy(ref).bfloat16()
        mlp.zero_grad(set_to_none=True)
        params = list(mlp.parameters())
        tiled_mlp(mlp, x.bfloat16(), num_tiles=num_tiles, params=params, linears=linears_of(mlp)).backward(
            grad_out.bfloat16())
        errors[num_tiles] = max(
            ((p.grad.double() - r.grad).norm() / r.grad.norm()).item() for p, r in zip(params, ref.parameters())
        )
    return errors


def test_tiled_mlp_bf16_weight_gradients_rounded_once():
    """bf16 MLP over 64 tiles: the weight gradients are summed in fp32 and rounded to bf16 once, so they are as close
    to the fp64 ones as the untiled MLP's (one matmul, one rounding); summed in a bf16 .grad tile by tile they were
    several times further off."""
    torch.manual_seed(0)
    errors = bf16_gradient_errors(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).double(), 64)
    # bf16 has 8 mantissa bits (2^-9 = 2e-3 relative rounding); both paths round each product sum once
    assert errors[64] < 1.5 * errors[1] + 1e-4, errors


def test_tiled_mlp_finds_llama_mlps_once():
    """Every decoder layer's MLP of a reference Llama is tiled; a second transform wraps nothing twice."""
    model = LlamaForCausalLM(LlamaConfig.from_name("tiny"))
    callback = TiledMLP(num_tiles=2)
    callback.fpdt_transform(model, list(model.model.layers))
    forwards = [layer.mlp.forward for layer in model.model.layers]
    assert all(getattr(f, "__wrapped__", None) is not None for f in forwards)
    callback.fpdt_transform(model, list(model.model.layers))
    assert [layer.mlp.forward for layer in model.model.layers] == forwards


# ---- TiledMLP: Linear gradients summed inside the matmul ------------------------------------------------------------
# fp64: the matmul path only regroups the sums (per tile, then over tiles) of products that are exact to ~1e-16, so
# every gradient is the untiled one's to ~1e-15 relative; 1e-12 leaves room for the tile count and nothing else.
EXACT = 1e-12


def assert_exact(got: torch.Tensor, want: torch.Tensor, name: str = "") -> None:
    error = ((got - want).norm() / want.norm()).item()
    assert error < EXACT, f"{name}: relative error {error:.2e}"


class GatedMLP(nn.Module):
    """gate/up/down with a trainable scale on the hidden product and a norm inside: parameters of no Linear."""

    def __init__(self, scaled: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.gate_proj, self.up_proj = nn.Linear(16, 40, bias=False), nn.Linear(16, 40, bias=False)
        self.down_proj = nn.Linear(40, 16, bias=False)
        self.scale = nn.Parameter(torch.rand(40) + 0.5) if scaled else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x) if self.scale is not None else x
        hidden = F.silu(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(hidden * self.scale if self.scale is not None else hidden)


class LoraLinear(nn.Module):
    """A LoRA-adapted Linear: the frozen base plus B(A(x)), A and B plain Linears."""

    def __init__(self, in_features: int, out_features: int, rank: int = 4) -> None:
        super().__init__()
        self.base_layer = nn.Linear(in_features, out_features).requires_grad_(False)
        self.lora_A = nn.Linear(in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, out_features, bias=False)
        nn.init.normal_(self.lora_B.weight)  # not zero as at the start of training: every gradient nonzero

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * 2.0


class LoraMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = LoraLinear(16, 40), LoraLinear(16, 40), LoraLinear(40, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TwiceMLP(nn.Module):
    """Calls one Linear twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.out = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inner(torch.tanh(self.inner(x)))))


class ReadsWeightMLP(TwiceMLP):
    """Reads a Linear's weight outside the Linear's forward too (as DoRA reads its adapters' weights)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inner(x))) * self.inner.weight.norm()


class InPlaceMLP(TwiceMLP):
    """Overwrites a Linear's (3-D, a view) output in place: the output's recorded graph node is replaced."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu_(self.inner(x)))


def biased_sequential() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 16))


def tiled_against_untiled(mlp: nn.Module, num_tiles: int, monkeypatch, dtype=torch.float64):
    """Runs ``mlp`` tiled (through apply_tiled_mlp) and an untiled copy on fresh random inputs; returns both
    modules, both input gradients and how many tiles took the matmul path."""
    tiles = []
    accumulate = LinearGradients.accumulate
    monkeypatch.setattr(LinearGradients, "accumulate", lambda self, *a: tiles.append(1) or accumulate(self, *a))
    mlp = mlp.to(dtype)
    ref = copy.deepcopy(mlp)
    apply_tiled_mlp(mlp, num_tiles=num_tiles, mlp_classes=[type(mlp).__name__])
    x = torch.randn(2, 7, 16, dtype=dtype, requires_grad=True)  # 14 tokens: 3 and 5 do not divide them
    x_ref = x.detach().clone().requires_grad_()
    grad_out = torch.randn(2, 7, 16, dtype=dtype)
    mlp(x).backward(grad_out)
    ref(x_ref).backward(grad_out)
    return mlp, ref, x.grad, x_ref.grad, len(tiles)


def assert_grads_exact(mlp: nn.Module, ref: nn.Module) -> None:
    for (name, p), r in zip(mlp.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (r.grad is None), name
        if r.grad is not None:
            assert_exact(p.grad, r.grad, name)


@pytest.mark.parametrize("make_mlp", [GatedMLP, biased_sequential], ids=["gated", "sequential"])
@pytest.mark.parametrize("num_tiles", [3, 5])
def test_linear_grads_summed_in_matmul_exact(make_mlp, num_tiles, monkeypatch):
    """Several tiles: every tile takes the matmul path, and the input, weight and bias gradients are the untiled
    MLP's (fp64)."""
    mlp, ref, grad_x, grad_x_ref, tiles = tiled_against_untiled(make_mlp(), num_tiles, monkeypatch)
    assert tiles == num_tiles
    assert_exact(grad_x, grad_x_ref, "input")
    assert_grads_exact(mlp, ref)


def test_linear_grads_frozen_weight(monkeypatch):
    """A frozen Linear gets no gradient; the trainable ones equal the untiled MLP's."""
    mlp = GatedMLP()
    mlp.up_proj.weight.requires_grad_(False)
    mlp, ref, grad_x, grad_x_ref, tiles = tiled_against_untiled(mlp, 3, monkeypatch)
    assert tiles == 3 and mlp.up_proj.weight.grad is None
    assert_exact(grad_x, grad_x_ref, "input")
    assert_grads_exact(mlp, ref)


def test_linear_grads_lora(monkeypatch):
    """LoRA-shaped layers: only lora_A and lora_B get gradients (the frozen base none), equal to the untiled."""
    mlp, ref, grad_x, grad_x_ref, tiles = tiled_against_untiled(LoraMLP(), 3, monkeypatch)
    assert tiles == 3
    with_grad = {name for name, p in mlp.named_parameters() if p.grad is not None}
    assert with_grad == {f"{proj}.lora_{ab}.weight" for proj in ("gate_proj", "up_proj", "down_proj") for ab in "AB"}
    assert_exact(grad_x, grad_x_ref, "input")
    assert_grads_exact(mlp, ref)


def test_linear_grads_layer_called_twice(monkeypatch):
    """A Linear called twice in one forward: both calls' products are summed into its gradient, exact."""
    mlp, ref, grad_x, grad_x_ref, tiles = tiled_against_untiled(TwiceMLP(), 3, monkeypatch)
    assert tiles == 3
    assert_exact(grad_x, grad_x_ref, "input")
    assert_grads_exact(mlp, ref)


@pytest.mark.parametrize("make_mlp", [ReadsWeightMLP, InPlaceMLP], ids=["weight-read", "in-place"])
def test_linear_grads_fall_back_to_autograd(make_mlp, monkeypatch):
    """A weight used outside its Linear's recorded output: no tile takes the matmul path, autograd's parameter
    gradients are summed instead, exact."""
    mlp, ref, grad_x, grad_x_ref, tiles = tiled_against_untiled(make_mlp(), 3, monkeypatch)
    assert tiles == 0
    assert_exact(grad_x, grad_x_ref, "input")
    assert_grads_exact(mlp, ref)


def test_linear_grads_with_other_parameters(monkeypatch):
    """Parameters of no Linear (a norm, a scale vector) keep autograd's gradient per tile; all are exact."""
    mlp, ref, grad_x, grad_x_ref, tiles = tiled_against_untiled(GatedMLP(scaled=True), 5, monkeypatch)
    assert tiles == 5
    assert_exact(grad_x, grad_x_ref, "input")
    assert_grads_exact(mlp, ref)


def test_one_tile_is_plain_autograd_bitwise(monkeypatch):
    """One tile (bf16): no hooks, no fp32 sums; the gradients are bit for bit autograd's on the whole tile, with or
    without the Linear layers named."""
    monkeypatch.setattr(LinearGradients, "__init__", lambda *a: pytest.fail("LinearGradients made for one tile"))
    mlp = GatedMLP(scaled=True).bfloat16()
    x = torch.randn(2, 7, 16, dtype=torch.bfloat16)
    grad_out = torch.randn(2, 7, 16, dtype=torch.bfloat16)
    results = []
    for linears in ([m for m in mlp.modules() if isinstance(m, nn.Linear)], ()):
        mlp.zero_grad(set_to_none=True)
        x_in = x.clone().requires_grad_()
        tiled_mlp(mlp, x_in, num_tiles=1, params=list(mlp.parameters()), linears=linears).backward(grad_out)
        results.append([x_in.grad] + [p.grad for p in mlp.parameters()])
    mlp.zero_grad(set_to_none=True)
    x_in = x.clone().requires_grad_()
    mlp(x_in.view(1, 14, 16)).backward(grad_out.view(1, 14, 16))  # the one tile the tiled MLP runs
    results.append([x_in.grad] + [p.grad for p in mlp.parameters()])
    for got in results[:2]:
        assert all(torch.equal(a, b) for a, b in zip(got, results[2]))


def test_linear_grads_bf16_rounded_once():
    """bf16 over 64 tiles on the matmul path: the weight and bias gradients are as close to the fp64 ones as the
    untiled MLP's (one matmul, one rounding)."""
    errors = bf16_gradient_errors(biased_sequential().double(), 16, lambda mlp: [mlp[0], mlp[2]])
    # bf16 has 8 mantissa bits (2^-9 relative rounding); both round each gradient once, from fp32 sums
    assert errors[64] < 1.5 * errors[1] + 1e-4, errors


def test_linear_grads_under_autocast(monkeypatch):
    """fp32 weights under bf16 autocast: the matmul path runs (its sums outside autocast, the inputs cast as the
    layers cast them) and its gradients are as close to fp64 as autograd's tile by tile."""
    tiles = []
    accumulate = LinearGradients.accumulate
    monkeypatch.setattr(LinearGradients, "accumulate", lambda self, *a: tiles.append(1) or accumulate(self, *a))
    mlp = biased_sequential()
    x, grad_out = torch.randn(2, 300, 16), torch.randn(2, 300, 16)
    ref = copy.deepcopy(mlp).double()
    ref(x.double()).backward(grad_out.double())
    errors = {}
    for path, linears in (("matmul", [mlp[0], mlp[2]]), ("autograd", [])):
        mlp.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = tiled_mlp(mlp, x, num_tiles=5, params=list(mlp.parameters()), linears=linears)
        out.backward(grad_out.bfloat16())
        errors[path] = max(((p.grad.double() - r.grad).norm() / r.grad.norm()).item()
                           for p, r in zip(mlp.parameters(), ref.parameters()))
    assert len(tiles) == 5
    # bf16 matmul operands (2^-9 relative rounding) set both errors; the matmul path rounds no per-tile product
    assert errors["matmul"] < 1.5 * errors["autograd"], errors


class OddMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(x))


def test_tiled_mlp_by_class_name():
    """mlp_classes tiles modules of those class names (and equals the untiled module)."""
    model = nn.ModuleList([OddMLP(), OddMLP()]).double()
    ref = copy.deepcopy(model)
    apply_tiled_mlp(model, num_tiles=4, mlp_classes=["OddMLP"])
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(model[1](model[0](x)), ref[1](ref[0](x)), **FP64_TOL)
    assert all(getattr(m, "_fpdt_tiled_mlp", False) for m in model)


def test_tiled_mlp_validation_messages():
    """Bad tile counts, class names that match nothing, no MLP, and dropout inside an MLP are refused."""
    with pytest.raises(ValueError, match=r"TiledMLP\(num_tiles=0\).*positive int"):
        TiledMLP(num_tiles=0)
    with pytest.raises(ValueError, match=r"num_tiles='3'"):
        TiledMLP(num_tiles="3")
    with pytest.raises(ValueError, match=r"tiled_mlp\(num_tiles=0\)"):
        tiled_mlp(torch.tanh, torch.randn(3, 4), num_tiles=0)
    with pytest.raises(ValueError, match=r"mlp_classes=\[\]"):
        TiledMLP(mlp_classes=[])
    with pytest.raises(ValueError, match=r"no module of class \['NoSuchMLP'\].*mlp_classes"):
        apply_tiled_mlp(gated_mlp(), mlp_classes=["NoSuchMLP"])
    with pytest.raises(ValueError, match=r"no gated MLP.*mlp_classes=\['MyMLP'\]"):
        apply_tiled_mlp(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"dropout \(p=0.1\).*set the MLP dropout to 0"):
        apply_tiled_mlp(nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.1), nn.Linear(8, 4)))


# ---- tiled cross-entropy ------------------------------------------------------------------------------------------
def ce_inputs(dtype: torch.dtype = torch.float64, all_ignored: bool = False):
    hidden = torch.randn(2, 7, 16, dtype=dtype, requires_grad=True)
    weight = torch.randn(11, 16, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 11, (2, 7))
    targets[0, :4] = -100
    targets[1, 5] = -100
    if all_ignored:
        targets[:] = -100
    return hidden, weight, targets


def reference_ce(hidden, weight, targets):
    logits = F.linear(hidden, weight).to(torch.promote_types(hidden.dtype, torch.float32))
    total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    count = (targets != -100).sum()
    return total / count.clamp(min=1), count


@pytest.mark.parametrize("num_tiles", [1, 3, 5, 40, "auto"])
def test_tiled_cross_entropy_matches_cross_entropy(num_tiles):
    """Mean, valid count and the gradients of hidden and weight equal F.cross_entropy's (fp64, uneven tiles)."""
    hidden, weight, targets = ce_inputs()
    h_ref, w_ref = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    scale = torch.rand((), dtype=torch.float64) + 0.5  # a gradient of the loss that is not 1 (SP re-weighting)

    mean, count = tiled_cross_entropy(hidden, weight, targets, num_tiles=num_tiles)
    mean_ref, count_ref = reference_ce(h_ref, w_ref, targets)
    torch.testing.assert_close(mean, mean_ref, **FP64_TOL)
    torch.testing.assert_close(mean, F.cross_entropy(F.linear(h_ref, w_ref).flatten(0, 1), targets.flatten()),
                               **FP64_TOL)
    assert count.item() == count_ref.item() == 9
    (mean * scale).backward()
    (mean_ref * scale).backward()
    torch.testing.assert_close(hidden.grad, h_ref.grad, **FP64_TOL)
    torch.testing.assert_close(weight.grad, w_ref.grad, **FP64_TOL)


def test_tiled_cross_entropy_all_ignored():
    """No valid target: loss 0 and zero gradients, never NaN."""
    hidden, weight, targets = ce_inputs(all_ignored=True)
    mean, count = tiled_cross_entropy(hidden, weight, targets, num_tiles=3)
    assert mean.item() == 0.0 and count.item() == 0
    mean.backward()
    assert torch.equal(hidden.grad, torch.zeros_like(hidden)) and torch.equal(weight.grad, torch.zeros_like(weight))


def test_tiled_cross_entropy_low_precision(monkeypatch):
    """bf16 inputs: fp32 loss, bf16 gradients within bf16 rounding of the fp64 ones; lm_head gradient accumulated
    in vocabulary slices (forced to 3 rows here)."""
    monkeypatch.setattr(tiled_loss_module, "WEIGHT_GRAD_SLICE_BYTES", 3 * 16 * 2)
    hidden, weight, targets = ce_inputs()
    hb, wb = hidden.detach().bfloat16().requires_grad_(), weight.detach().bfloat16().requires_grad_()
    mean, _ = tiled_cross_entropy(hb, wb, targets, num_tiles=3)
    mean.backward()
    mean_ref, _ = reference_ce(hb.detach().double().requires_grad_(), wb.detach().double(), targets)
    ref_h, ref_w = (hb.detach().double().requires_grad_(), wb.detach().double().requires_grad_())
    reference_ce(ref_h, ref_w, targets)[0].backward()
    assert mean.dtype == torch.float32 and hb.grad.dtype == wb.grad.dtype == torch.bfloat16
    # bf16 logits (8 mantissa bits) and bf16 gradient products: ~1e-2 relative
    torch.testing.assert_close(mean.double(), mean_ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(hb.grad.double(), ref_h.grad, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(wb.grad.double(), ref_w.grad, rtol=2e-2, atol=2e-3)


def test_tiled_cross_entropy_without_grad_and_twice():
    """Under no_grad it returns the same loss; a second backward through a retained graph raises, not wrong grads."""
    hidden, weight, targets = ce_inputs()
    with torch.no_grad():
        plain, _ = tiled_cross_entropy(hidden, weight, targets, num_tiles=3)
    mean, _ = tiled_cross_entropy(hidden, weight, targets, num_tiles=3)
    torch.testing.assert_close(plain, mean, **FP64_TOL)
    (mean * 2).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        (mean * 2).backward()


def test_tiled_cross_entropy_validation_messages():
    """Bad tile counts and mismatched shapes are refused with the shapes printed."""
    hidden, weight, targets = ce_inputs()
    with pytest.raises(ValueError, match=r"tiled_cross_entropy\(num_tiles=0\)"):
        tiled_cross_entropy(hidden, weight, targets, num_tiles=0)
    with pytest.raises(ValueError, match=r"hidden \(2, 7, 16\), weight \(11, 8\), targets \(2, 7\)"):
        tiled_cross_entropy(hidden, weight[:, :8], targets)
    with pytest.raises(ValueError, match=r"targets \(2, 6\)"):
        tiled_cross_entropy(hidden, weight, targets[:, :6])
    with pytest.raises(ValueError, match=r"TiledLoss\(num_tiles=-1\)"):
        TiledLoss(num_tiles=-1)
    with pytest.raises(ValueError, match=r"not Linear.*tiled_cross_entropy\(hidden, weight, targets\)"):
        apply_tiled_loss(nn.Linear(4, 4))


@pytest.mark.parametrize("tied", [False, True])
def test_tiled_loss_reference_llama(tied):
    """The reference Llama's loss and every gradient (the tied embedding's two uses included) equal the untiled."""
    model = LlamaForCausalLM(LlamaConfig.from_name("tiny", tie_word_embeddings=tied)).double()
    ref = copy.deepcopy(model)
    ref.tie_weights()  # deepcopy keeps the sharing; re-tie anyway, as materialising would
    TiledLoss(num_tiles=3).fpdt_transform(model, list(model.model.layers))
    input_ids = torch.randint(0, 256, (2, 9))
    labels = input_ids.clone()
    labels[0, :5] = -100
    loss, loss_ref = model(input_ids, labels=labels), ref(input_ids, labels=labels)
    torch.testing.assert_close(loss, loss_ref, **FP64_TOL)
    loss.backward()
    loss_ref.backward()
    for name, g in grads(model).items():
        torch.testing.assert_close(g, grads(ref)[name], **FP64_TOL, msg=lambda m: f"{name}: {m}")
    assert model(input_ids).shape == (2, 9, 256)  # without labels: logits as before


def hf_llama(**config) -> nn.Module:
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM as HFLlama

    return HFLlama(HFConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa", **config))


@pytest.mark.parametrize("tied", [False, True])
def test_tiled_loss_hugging_face(tied):
    """A HF *ForCausalLM: labels are shifted as HF does, loss and gradients equal HF's; logits=None with labels."""
    model = hf_llama(tie_word_embeddings=tied).double()
    ref = copy.deepcopy(model)
    apply_tiled_loss(model, num_tiles=4)
    apply_tiled_loss(model, num_tiles=4)  # idempotent
    input_ids = torch.randint(0, 64, (2, 9))
    labels = input_ids.clone()
    labels[1, :6] = -100
    out, out_ref = model(input_ids=input_ids, labels=labels), ref(input_ids=input_ids, labels=labels)
    assert out.logits is None
    # HF upcasts logits to fp32 (also fp64 ones), so its loss is fp32: compare to fp32 precision (~1e-7 relative)
    tol = dict(rtol=1e-5, atol=1e-6, check_dtype=False)
    torch.testing.assert_close(out.loss, out_ref.loss, **tol)
    out.loss.backward()
    out_ref.loss.backward()
    for name, g in grads(model).items():
        torch.testing.assert_close(g, grads(ref)[name], **tol, msg=lambda m: f"{name}: {m}")
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    torch.testing.assert_close(model(input_ids, shift_labels=shifted).loss, out.loss, **FP64_TOL)
    torch.testing.assert_close(model(input_ids).logits, ref(input_ids).logits, **FP64_TOL)


def test_tiled_loss_hugging_face_num_items_in_batch():
    """num_items_in_batch (gradient accumulation in HF's style): the loss is the batch's sum over that count, as
    HF's own loss computes it; under the fpdt strategy (fpdt_reduce_loss set) passing it is refused."""
    model = hf_llama().double()
    ref = copy.deepcopy(model)
    apply_tiled_loss(model, num_tiles=3)
    input_ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    labels = input_ids.clone()
    labels[0, :3] = -100
    out = model(input_ids=input_ids, labels=labels, num_items_in_batch=37)
    out_ref = ref(input_ids=input_ids, labels=labels, num_items_in_batch=37)
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-5, atol=1e-6, check_dtype=False)  # HF's fp32 loss
    model.fpdt_reduce_loss = lambda mean, num_valid: mean
    with pytest.raises(ValueError, match="do not pass num_items_in_batch"):
        model(input_ids=input_ids, labels=labels, num_items_in_batch=37)


def test_tiled_loss_hugging_face_refusals():
    """An lm_head bias or logit soft-capping, which the tiled loss does not model, is refused."""
    model = hf_llama()
    model.lm_head = nn.Linear(32, 64, bias=True)
    with pytest.raises(ValueError, match="lm_head has a bias"):
        apply_tiled_loss(model)
    model = hf_llama()
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match=r"final_logit_softcapping=30.0"):
        apply_tiled_loss(model)


# ---- the callbacks with a plain single-device Trainer -------------------------------------------------------------
def fit(kind: str, callbacks: list, steps: int = 3) -> LitLM:
    dataset = TokenDataset(num_samples=2 * steps, seq_len=12, seed=7)
    module = LitLM(kind, seed=1234, lr=0.5)
    trainer = L.Trainer(devices=1, max_steps=steps, callbacks=callbacks, **trainer_kwargs())
    trainer.fit(module, DataLoader(dataset, batch_size=2, shuffle=False))
    return module


@pytest.mark.parametrize("kind", ["llama", "hf"])
def test_callbacks_single_device_training_parity(kind):
    """Without the fpdt strategy both callbacks transform the model at setup; 3 SGD steps end where untiled ones do."""
    tiled = fit(kind, [TiledMLP(num_tiles=3), TiledLoss(num_tiles=3)])
    plain = fit(kind, [])
    assert all(getattr(m, "_fpdt_tiled_mlp", False) for m in tiled.model.modules() if hasattr(m, "gate_proj"))
    assert getattr(tiled.model, "_fpdt_tiled_loss", False)
    torch.testing.assert_close(torch.tensor(tiled.losses), torch.tensor(plain.losses), **FP32_TOL)
    reference = full_state(plain)
    for name, value in full_state(tiled).items():
        torch.testing.assert_close(value, reference[name], **FP32_TOL, msg=lambda m: f"{name}: {m}")


class LateLM(LitLM):
    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.lr, self.losses = 0.5, []

    def configure_model(self) -> None:
        self.kind, self.model = "llama", LlamaForCausalLM(LlamaConfig.from_name("tiny"))


def test_callback_without_fpdt_needs_a_built_model():
    """Without the fpdt strategy a model built in configure_model cannot be transformed at setup: said clearly."""
    trainer = L.Trainer(devices=1, max_steps=1, callbacks=[TiledMLP()], **trainer_kwargs())
    with pytest.raises(ValueError, match=r"TiledMLP.*LateLM has no parameters yet.*strategy='fpdt'"):
        trainer.fit(LateLM(), DataLoader(TokenDataset(2, 12, seed=0), batch_size=2))
