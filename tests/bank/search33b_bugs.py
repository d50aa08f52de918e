"""Round 33 (tester): right attempts at the module exercises and 10.3 / 11.3 / 6.2 that stress the mutation,
global-setting and device probes, and a few wrong ones."""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint

from bank.attempts import Attempt, new_bank
from bank.model_bugs import GivenBlock
from course_lib import flash
from course_lib.attention import MaskedAttention, MultiHeadMaskedAttention, merge_heads, split_heads
from course_lib.flash import FlashAttentionFunction
from course_lib.model import GPT
from course_lib.modern import RMSNorm, SwiGLU, apply_rotary, repeat_kv

BUGGY, CORRECT, bug, correct = new_bank()
NEG = float("-inf")


# ------------------------------------------------------------------ 2.2 / 3.3
@correct("2.2")
class MaskedRecordsWeightsInABuffer(MaskedAttention):
    """Re-registers a non-persistent buffer with the last weights at every call, and counts its calls."""
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.embed_dim)
        scores = scores.masked_fill(~self.mask[:length, :length], NEG)
        weights = torch.softmax(scores, -1)
        self.register_buffer("last_weights", weights.detach(), persistent=False)
        self.calls = getattr(self, "calls", 0) + 1
        weights = F.dropout(weights, p=self.attn_dropout.p, training=self.training)
        return F.dropout(self.proj(weights @ v), p=self.proj_dropout.p, training=self.training)


@correct("2.2")
class MaskedMovesItsMaskBuffer(MaskedAttention):
    """Reassigns the mask buffer to x's device when it differs (a buffer written in forward)."""
    def forward(self, x):
        if self.mask.device != x.device:
            self.mask = self.mask.to(x.device)
        length = x.size(1)
        scores = torch.einsum("nld,ntd->nlt", self.query(x), self.key(x)) * self.embed_dim ** -0.5
        scores = torch.where(self.mask[:length, :length], scores, NEG)
        return self.proj_dropout(self.proj(self.attn_dropout(scores.softmax(-1)) @ self.value(x)))


@correct("3.3")
class MultiFunctionalDropoutOfModules(MultiHeadMaskedAttention):
    def forward(self, x):
        n, length, e = x.shape
        q, k, v = (split_heads(lin(x), self.num_heads) for lin in (self.query, self.key, self.value))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(self.mask[:length, :length].logical_not(), NEG)
        w = F.dropout(scores.softmax(-1), self.attn_dropout.p, self.attn_dropout.training)
        out = merge_heads(w @ v)
        return F.dropout(self.proj(out), self.proj_dropout.p, self.proj_dropout.training)


@correct("3.3")
class MultiAutocastOffAndNoGradMaskCache(MultiHeadMaskedAttention):
    """A mask slice kept on the module, made under no_grad; the maths inside an autocast block switched off."""
    def forward(self, x):
        length = x.shape[1]
        with torch.no_grad():
            self._hidden = ~self.mask[:length, :length]
        with torch.autocast("cpu", enabled=False):
            q = split_heads(self.query(x), self.num_heads)
            k = split_heads(self.key(x), self.num_heads)
            v = split_heads(self.value(x), self.num_heads)
            w = (q @ k.transpose(-2, -1) / self.head_dim ** 0.5).masked_fill(self._hidden, NEG).softmax(-1)
            return self.proj_dropout(self.proj(merge_heads(self.attn_dropout(w) @ v)))


@bug("3.3", "mutation", "in place")
class MultiRescalesQueryInPlace(MultiHeadMaskedAttention):
    """Folds the 1/sqrt(d_h) into the query weights in place at every call."""
    def forward(self, x):
        length = x.shape[1]
        with torch.no_grad():
            self.query.weight.mul_(1.0)      # no change...
            self.query.weight.add_(0.0)
            self.key.weight.clamp_(-0.5, 0.5)   # ...but this one
        q, k, v = (split_heads(lin(x), self.num_heads) for lin in (self.query, self.key, self.value))
        w = (q @ k.transpose(-2, -1) / self.head_dim ** 0.5).masked_fill(~self.mask[:length, :length], NEG)
        return self.proj_dropout(self.proj(merge_heads(self.attn_dropout(w.softmax(-1)) @ v)))


# ------------------------------------------------------------------ 4.2 / 4.3
@correct("4.2")
class BlockCheckpointed(GivenBlock):
    """Gradient checkpointing around each sublayer (torch.utils.checkpoint keeps dropout's RNG)."""
    def __init__(self, embed_dim, num_heads, max_tokens, dropout_rate=0.0, norm_first=True):
        super().__init__(embed_dim, num_heads, max_tokens, dropout_rate)
        self.norm_first = norm_first

    def forward(self, x):
        if self.norm_first:
            x = x + checkpoint(lambda h: self.attn(self.ln1(h)), x, use_reentrant=False)
            return x + checkpoint(lambda h: self.mlp(self.ln2(h)), x, use_reentrant=False)
        x = self.ln1(x + checkpoint(self.attn, x, use_reentrant=False))
        return self.ln2(x + checkpoint(self.mlp, x, use_reentrant=False))


@correct("4.2")
class BlockPostNormTorchAdd(GivenBlock):
    def __init__(self, embed_dim, num_heads, max_tokens, dropout_rate=0.0, norm_first=True):
        super().__init__(embed_dim, num_heads, max_tokens, dropout_rate)
        self.norm_first = norm_first

    def forward(self, x):
        if not self.norm_first:
            h = self.ln1(torch.add(x, self.attn(x)))
            return self.ln2(torch.add(h, self.mlp(h)))
        h = x + self.attn(self.ln1(x))
        self.last_residual = h.detach()          # an attribute written in forward
        return h + self.mlp(self.ln2(h))


@correct("4.3")
class GPTCheckpointedBlocks(GPT):
    def forward(self, idx):
        length = idx.shape[-1]
        x = F.dropout(self.token_embedding(idx) + self.position_encoding(length), self.dropout.p, self.training)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.training else block(x)
        return self.head(self.ln_f(x))


@correct("4.3")
class GPTLengthFromSize(GPT):
    """len(idx[0]) for the length, and the step counted in a buffer."""
    def forward(self, idx):
        if not hasattr(self, "steps"):
            self.register_buffer("steps", torch.zeros((), dtype=torch.long, device=idx.device), persistent=False)
        self.steps += 1
        length = len(idx[0])
        if length > self.config.max_tokens:
            raise ValueError(f"idx has {length} tokens, more than max_tokens={self.config.max_tokens}: crop it "
                             f"to its last max_tokens tokens")
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(length)[None])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@bug("4.3", "dropout")
class GPTDropoutFixedRate(GPT):
    def forward(self, idx):
        x = F.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]), 0.1, self.training)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ------------------------------------------------------------------ 9.4 SwiGLU
@correct("9.4")
class SwiGLUFunctionalR33(SwiGLU):
    def forward(self, x):
        g = F.linear(x, self.gate.weight)
        return F.linear(g * torch.sigmoid(g) * F.linear(x, self.up.weight), self.down.weight)


@correct("9.4")
class SwiGLUCheckpointed(SwiGLU):
    def forward(self, x):
        return checkpoint(lambda t: self.down(F.silu(self.gate(t)) * self.up(t)), x, use_reentrant=False)


@correct("9.4")
class SwiGLUNoGradStatistics(SwiGLU):
    """Records the share of open gates under no_grad, as an attribute."""
    def forward(self, x):
        gate = F.silu(self.gate(x))
        with torch.no_grad():
            self.open_share = (gate > 0).float().mean()
        return self.down(gate * self.up(x))


# ------------------------------------------------------------------ 9.6 GQA with options
class GQAOptions(nn.Module):
    """A constructor with modern.GroupedQueryAttention's options, dropout as an nn.Dropout module on the weights."""

    def __init__(self, embed_dim, num_heads, num_kv_heads, max_tokens, rope_theta=10000.0, *, qk_norm=False,
                 sliding_window=None, dropout_rate=0.0, norm_eps=1e-6, head_dim=None):
        super().__init__()
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.groups = num_heads // num_kv_heads
        self.head_dim = head_dim or embed_dim // num_heads
        self.max_tokens, self.sliding_window, self.dropout_rate = max_tokens, sliding_window, dropout_rate
        hd = self.head_dim
        self.query = nn.Linear(embed_dim, num_heads * hd, bias=False)
        self.key = nn.Linear(embed_dim, num_kv_heads * hd, bias=False)
        self.value = nn.Linear(embed_dim, num_kv_heads * hd, bias=False)
        self.proj = nn.Linear(num_heads * hd, embed_dim, bias=False)
        self.q_norm = RMSNorm(hd, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(hd, norm_eps) if qk_norm else None
        self.attn_dropout = nn.Dropout(dropout_rate)
        from course_lib.modern import rope_tables
        cos, sin = rope_tables(hd, max_tokens, rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def new_cache(self):
        from course_lib import KVCache
        return KVCache(self.max_tokens)


@correct("9.6")
class GQAByHandWithDropoutModule(GQAOptions):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q = split_heads(self.query(x), self.num_heads)
        k = split_heads(self.key(x), self.num_kv_heads)
        v = split_heads(self.value(x), self.num_kv_heads)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(k, self.rope_cos, self.rope_sin, offset=start)
        if cache is not None:
            k, v = cache.append(k, v)
        k, v = repeat_kv(k, self.groups), repeat_kv(v, self.groups)
        total = k.shape[2]
        i = torch.arange(start, total, device=x.device)[:, None]
        j = torch.arange(total, device=x.device)[None, :]
        mask = j <= i
        if self.sliding_window is not None:
            mask = mask & (i - j < self.sliding_window)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        w = self.attn_dropout(scores.masked_fill(~mask, NEG).softmax(-1))
        return self.proj(merge_heads(w @ v))


# ------------------------------------------------------------------ 10.3 FlashAttentionFunction
def _bw(ctx, grad_out, q, k, v, out, lse, *, mask="arange", zeros=torch.zeros_like):
    scale = 1.0 / math.sqrt(q.shape[-1])
    lq, lk = q.shape[-2], k.shape[-2]
    dq, dk, dv = zeros(q), zeros(k), zeros(v)
    delta = (grad_out * out).sum(-1)
    for qs in range(0, lq, ctx.block_q):
        qe = min(qs + ctx.block_q, lq)
        qb, dob = q[..., qs:qe, :], grad_out[..., qs:qe, :]
        for ks in range(0, min(lk, qe) if ctx.causal else lk, ctx.block_k):
            ke = min(ks + ctx.block_k, lk)
            kb, vb = k[..., ks:ke, :], v[..., ks:ke, :]
            s = qb @ kb.transpose(-2, -1) * scale
            if ctx.causal and ke - 1 > qs:
                if mask == "tril":
                    keep = torch.ones(qe - qs, ke - ks, dtype=torch.bool, device=q.device).tril(qs - ks)
                    s = s.masked_fill(~keep, NEG)
                else:
                    i = torch.arange(qs, qe, device=q.device)[:, None]
                    j = torch.arange(ks, ke, device=q.device)[None, :]
                    s = torch.where(j > i, NEG, s)
            p = torch.exp(s - lse[..., qs:qe, None])
            dv[..., ks:ke, :] += p.transpose(-2, -1) @ dob
            ds = p * (dob @ vb.transpose(-2, -1) - delta[..., qs:qe, None])
            dq[..., qs:qe, :] += ds @ kb * scale
            dk[..., ks:ke, :] += ds.transpose(-2, -1) @ qb * scale
    return dq, dk, dv


@correct("10.3")
class BackwardOnceDifferentiable(FlashAttentionFunction):
    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        return (*_bw(ctx, grad_out, *ctx.saved_tensors, mask="tril"), None, None, None)


@correct("10.3")
class BackwardNeedsInputGrad(FlashAttentionFunction):
    """None for an input that needs no gradient (ctx.needs_input_grad), as the autograd docs show."""
    @staticmethod
    def backward(ctx, grad_out):
        dq, dk, dv = _bw(ctx, grad_out, *ctx.saved_tensors)
        need = ctx.needs_input_grad
        return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None, None, None, None)


@correct("10.3")
class BackwardExtraTrailingNone(FlashAttentionFunction):
    """Seven values: autograd accepts trailing Nones beyond the inputs."""
    @staticmethod
    def backward(ctx, grad_out):
        return (*_bw(ctx, grad_out, *ctx.saved_tensors, zeros=torch.zeros_like),
                None, None, None, None)


@correct("10.3")
class BackwardOwnForwardSavesScale(torch.autograd.Function):
    """Its own forward (same as given) that also keeps the scale on ctx and marks lse non-differentiable-free."""
    @staticmethod
    def forward(ctx, q, k, v, causal=False, block_q=64, block_k=64):
        out, lse = flash.flash_attention(q, k, v, block_q=block_q, block_k=block_k, causal=causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.block_q, ctx.block_k = causal, block_q, block_k
        ctx.scale = q.shape[-1] ** -0.5
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.no_grad():
            grads = _bw(ctx, grad_out.contiguous(), q, k, v, out, lse)
        return grads[0], grads[1], grads[2], None, None, None


@correct("10.3")
class BackwardEmptyThenZero(FlashAttentionFunction):
    """torch.empty_like(...).zero_() and a recomputed delta per block."""
    @staticmethod
    def backward(ctx, grad_out):
        return (*_bw(ctx, grad_out, *ctx.saved_tensors, zeros=lambda t: torch.empty_like(t).zero_()), None, None,
                None)


@bug("10.3", "dtype")
class BackwardAccumulatesInFloat32(FlashAttentionFunction):
    @staticmethod
    def backward(ctx, grad_out):
        zeros = lambda t: torch.zeros(t.shape, device=t.device, dtype=torch.float32)  # noqa: E731
        return (*_bw(ctx, grad_out, *ctx.saved_tensors, zeros=zeros), None, None, None)


# ------------------------------------------------------------------ 11.3 ablate_head
def _cols(model, layer, head):
    attn = model.blocks[layer].attn
    return attn, slice(head * attn.head_dim, (head + 1) * attn.head_dim)


class AblateHeadClass:
    """A class with __enter__ / __exit__ and a keep-mask made like the input."""
    def __init__(self, model, layer, head):
        self.attn, self.cols = _cols(model, layer, head)
        self.model, self.handle = model, None

    def _hook(self, module, inputs):
        x = inputs[0]
        keep = torch.ones(x.shape[-1], device=x.device, dtype=x.dtype)
        keep[self.cols] = 0
        return (x * keep, *inputs[1:])

    def __enter__(self):
        self.handle = self.attn.proj.register_forward_pre_hook(self._hook)
        return self.model

    def __exit__(self, *exc):
        self.handle.remove()
        return False


CORRECT.append(Attempt("11.3", "AblateHeadClass", AblateHeadClass, None))


@correct("11.3")
@contextlib.contextmanager
def ablate_by_zeroed_proj_columns(model, layer, head):
    """Zero proj's columns in place, put the saved ones back in finally (the checker's docstring allows it)."""
    attn, cols = _cols(model, layer, head)
    saved = attn.proj.weight[:, cols].detach().clone()
    with torch.no_grad():
        attn.proj.weight[:, cols] = 0.0
    try:
        yield model
    finally:
        with torch.no_grad():
            attn.proj.weight[:, cols] = saved


class _ZeroColumns(nn.Module):
    def __init__(self, cols):
        super().__init__()
        self.cols = cols

    def forward(self, w):
        keep = torch.ones_like(w)
        keep[:, self.cols] = 0
        return w * keep


@correct("11.3")
@contextlib.contextmanager
def ablate_by_parametrization_r33(model, layer, head):
    """torch.nn.utils.parametrize on proj.weight, removed (original kept) in finally."""
    attn, cols = _cols(model, layer, head)
    parametrize.register_parametrization(attn.proj, "weight", _ZeroColumns(cols))
    try:
        yield model
    finally:
        parametrize.remove_parametrizations(attn.proj, "weight", leave_parametrized=False)


@correct("11.3")
@contextlib.contextmanager
def ablate_by_forward_hook_subtracting(model, layer, head):
    """A forward hook on proj that takes away the head's share of proj's output (its columns times its input)."""
    attn, cols = _cols(model, layer, head)

    def hook(module, inputs, output):
        return output - F.linear(inputs[0][..., cols], module.weight[:, cols])

    handle = attn.proj.register_forward_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


@correct("11.3")
@contextlib.contextmanager
def ablate_nested_exitstack_cat(model, layer, head):
    """An ExitStack holding the hook's removal; the zeros from torch.zeros_like, joined with torch.cat."""
    attn, cols = _cols(model, layer, head)

    def hook(module, inputs):
        x = inputs[0]
        return torch.cat([x[..., :cols.start], torch.zeros_like(x[..., cols]), x[..., cols.stop:]], dim=-1)

    with contextlib.ExitStack() as stack:
        handle = attn.proj.register_forward_pre_hook(hook)
        stack.callback(handle.remove)
        yield model


@correct("11.3")
@contextlib.contextmanager
def ablate_index_fill_no_grad_setup(model, layer, head):
    """The columns as an index made on the input's device; setup under torch.no_grad() as a block."""
    with torch.no_grad():
        attn, cols = _cols(model, layer, head)

    def hook(module, inputs):
        x = inputs[0]
        return (x.index_fill(-1, torch.arange(cols.start, cols.stop, device=x.device), 0.0),)

    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@correct("11.3")
@contextlib.contextmanager
def ablate_nested_with_inner_manager(model, layer, head):
    """The course's own building block twice over: a @contextmanager inside another, both with try/finally."""
    @contextlib.contextmanager
    def hooked(module, fn):
        h = module.register_forward_pre_hook(fn)
        try:
            yield
        finally:
            h.remove()
    attn, cols = _cols(model, layer, head)
    with hooked(attn.proj, lambda m, inp: (inp[0].masked_fill(
            (torch.arange(inp[0].shape[-1], device=inp[0].device) // attn.head_dim) == head, 0.0),)):
        yield model


@bug("11.3", "device", "device")
@contextlib.contextmanager
def ablate_keep_mask_on_cpu(model, layer, head):
    attn, cols = _cols(model, layer, head)
    keep = torch.ones(attn.proj.in_features)
    keep[cols] = 0

    def hook(module, inputs):
        return (inputs[0] * keep.to(inputs[0].dtype),)
    handle = attn.proj.register_forward_pre_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


# ------------------------------------------------------------------ 6.2 generate_with_cache
@correct("6.2")
@torch.inference_mode()
def generate_inference_mode(model, idx, max_new_tokens):
    cache = model.new_cache()
    logits = model(idx, cache)
    for step in range(max_new_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, nxt], 1)
        if step + 1 < max_new_tokens:
            logits = model(nxt, cache)
    return idx


@correct("6.2")
def generate_set_grad_enabled_block(model, idx, max_new_tokens):
    with torch.set_grad_enabled(False):
        cache = model.new_cache()
        logits = model(idx, cache)
        new = []
        for step in range(max_new_tokens):
            nxt = logits[:, -1:, :].argmax(-1)          # (N, 1)
            new.append(nxt)
            if step + 1 < max_new_tokens:
                logits = model(nxt, cache)
    return torch.cat([idx, *new], dim=1)


@correct("6.2")
def generate_grad_off_then_restored(model, idx, max_new_tokens):
    """Gradients off by hand, put back as found in finally."""
    was = torch.is_grad_enabled()
    torch.set_grad_enabled(False)
    try:
        cache = model.new_cache()
        logits = model(idx, cache)
        while idx.shape[1] < idx.shape[1] + max_new_tokens and max_new_tokens > 0:
            nxt = logits[:, -1].argmax(-1).unsqueeze(-1)
            idx = torch.cat((idx, nxt), dim=-1)
            max_new_tokens -= 1
            if max_new_tokens:
                logits = model(nxt, cache)
        return idx
    finally:
        torch.set_grad_enabled(was)


@bug("6.2", "global_setting", "torch.is_grad_enabled()")
def generate_grad_off_left_off(model, idx, max_new_tokens):
    torch.set_grad_enabled(False)
    cache = model.new_cache()
    logits = model(idx, cache)
    for step in range(max_new_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        idx = torch.cat([idx, nxt], 1)
        if step + 1 < max_new_tokens:
            logits = model(nxt, cache)
    return idx
