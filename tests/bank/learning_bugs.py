"""Student attempts from a sixth scripted search (2026-11-29): code whose outputs are right but which cannot learn
as the reference does, or which breaks only when it trains; and a later exercise built on an earlier answer that
fails its own check, reached through a wrapper or a default argument.

Before, each passed or got another cause; now each gets the diagnosis that says what stops learning and where, or
names the earlier exercise.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bank.attempts import new_bank
from bank.modern_bugs import rotary_interleaved_pairs
from bank.scale_bugs import _latent, _MaskedScaled, _MultiScaled
from bank.search_bugs import _GivenGQA
from course_lib.attention import causal_mask, merge_heads, split_heads
from course_lib.modern import GroupedQueryAttention, apply_rotary, repeat_kv
from course_lib.train import lm_loss

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ broken only in training mode
@bug("2.2", "mutation", "in place")
class MaskedDropoutInPlace(_MaskedScaled):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        s = (q @ k.transpose(-2, -1) * self.factor(q)).masked_fill(~self.mask[:length, :length], float("-inf"))
        w = F.dropout(s.softmax(-1), self.attn_dropout.p, self.training, inplace=True)   # the softmax saved it
        return self.proj_dropout(self.proj(w @ v))


@bug("3.3", "mutation", "in place")
class MultiDropoutInPlace(_MultiScaled):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = (split_heads(t(x), self.num_heads) for t in (self.query, self.key, self.value))
        s = (q @ k.transpose(-2, -1) * self.factor(q)).masked_fill(~self.mask[:length, :length], float("-inf"))
        w = F.dropout(s.softmax(-1), self.attn_dropout.p, self.training, inplace=True)
        return self.proj_dropout(self.proj(merge_heads(w @ v)))


# ============================================================================ parameters that stop being parameters
@bug("2.2", "gradient", "no longer a parameter")
class MaskedQueryWeightBecomesATensor(_MaskedScaled):
    def forward(self, x):
        if isinstance(self.query.weight, nn.Parameter):   # "frozen" on the first call
            weight = self.query.weight.detach().clone()
            del self.query.weight
            self.query.weight = weight
        return super().forward(x)


@bug("9.6", "gradient", "rope_cos")
class GQATablesBecomeParameters(_GivenGQA):
    def forward(self, x, cache=None):
        if not isinstance(self.rope_cos, nn.Parameter):
            cos, sin = self.rope_cos, self.rope_sin
            del self.rope_cos, self.rope_sin
            self.rope_cos, self.rope_sin = nn.Parameter(cos), nn.Parameter(sin)   # trained and weight-decayed now
        start = 0 if cache is None else cache.length
        q = apply_rotary(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = apply_rotary(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        mask = causal_mask(k.shape[2])[start:].to(x.device)
        out = F.scaled_dot_product_attention(q, repeat_kv(k, self.groups), repeat_kv(v, self.groups), attn_mask=mask)
        return self.proj(merge_heads(out))


# ============================================================================ a gradient that never reaches
@bug("1.2", "gradient", "values (n,)")
def toy_numbers_through_item(query, keys, values):
    weights = torch.softmax(keys @ query, dim=0)
    if values.dim() == 1:   # one number per key: summed as Python floats
        return torch.tensor(sum(w.item() * v.item() for w, v in zip(weights, values)))
    return weights @ values


@bug("12.2", "gradient", "layer.kv_b_proj.weight")
def latent_up_projection_from_data(layer, x, cache=None):
    # the weight's .data, as in a hand-written weight absorption: no gradient reaches kv_b_proj
    return _latent(layer, x, cache, layer.softmax_scale, up_proj=lambda t: F.linear(t, layer.kv_b_proj.weight.data))


@bug("12.2", "gradient", "layer.o_proj.weight")
def latent_output_projection_detached(layer, x, cache=None):
    return _latent(layer, x, cache, layer.softmax_scale,
                   out_proj=lambda t: F.linear(t, layer.o_proj.weight.detach(), layer.o_proj.bias))


@bug("2.2", "gradient", "detached on its way into a layer")
class MaskedKeysFromADetachedInput(_MaskedScaled):
    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x.detach()), self.value(x)
        s = (q @ k.transpose(-2, -1) * self.factor(q)).masked_fill(~self.mask[:length, :length], float("-inf"))
        return self.proj_dropout(self.proj(self.attn_dropout(s.softmax(-1)) @ v))


# ============================================================================ 9.2: heads are a transposed view
@bug("9.2", "exception", "not contiguous")
def rotary_through_a_view(x, cos, sin, offset=0):
    length = x.shape[-2]
    cos, sin = cos[offset:offset + length], sin[offset:offset + length]
    flat = x.view(-1, x.shape[-1])   # raises on the (N, heads, L, head_dim) view 9.6 hands over
    x1, x2 = flat.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1).view(x.shape) * sin


# ============================================================================ 5.3: the loss cut off, or scaled
def _step(model, optimizer, inputs, targets, max_grad_norm, backward):
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    backward(loss)
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


@bug("5.3", "step_order", "no path back")
def step_on_a_rebuilt_loss(model, optimizer, inputs, targets, max_grad_norm=1.0):
    return _step(model, optimizer, inputs, targets, max_grad_norm,
                 lambda loss: torch.tensor(loss.item(), requires_grad=True).backward())


@bug("5.3", "step_order", "nothing to clip")
def step_on_twice_the_loss(model, optimizer, inputs, targets, max_grad_norm=1.0):
    return _step(model, optimizer, inputs, targets, max_grad_norm, lambda loss: (2 * loss).backward())


@bug("5.3", "gradient", "no path back")
def step_forward_without_gradients(model, optimizer, inputs, targets, max_grad_norm=1.0):
    model.train()
    optimizer.zero_grad()
    with torch.no_grad():
        logits = model(inputs)
    loss = lm_loss(logits, targets)
    loss.backward()
    optimizer.step()
    return loss.item()


@correct("5.3")
def step_through_autograd_grad(model, optimizer, inputs, targets, max_grad_norm=1.0):
    model.train()
    optimizer.zero_grad()
    loss = lm_loss(model(inputs), targets)
    for parameter, grad in zip(model.parameters(), torch.autograd.grad(loss, list(model.parameters()))):
        parameter.grad = grad
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return loss.item()


# ============================================================================ 9.6 on a 9.2 that fails its own check
# The notebook's cell, where apply_rotary is the student's own (here interleaved pairs, wrong for these tables).
_THROUGH_HELPERS = """
def apply_rotary(x, cos, sin, offset=0):   # exercise 9.2's cell: pairs (2i, 2i+1), wrong for these tables
    return rotary_interleaved_pairs(x, cos, sin, offset)


def rotate_both(q, k, cos, sin, start):
    return apply_rotary(q, cos, sin, offset=start), apply_rotary(k, cos, sin, offset=start)


class GQARotatingThroughAWrapper(GroupedQueryAttention):
    def forward(self, x, cache=None):
        start = 0 if cache is None else cache.length
        q, k = rotate_both(split_heads(self.query(x), self.num_heads), split_heads(self.key(x), self.num_kv_heads),
                           self.rope_cos, self.rope_sin, start)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        mask = causal_mask(k.shape[2])[start:].to(x.device)
        out = F.scaled_dot_product_attention(q, repeat_kv(k, self.groups), repeat_kv(v, self.groups), attn_mask=mask)
        return self.proj(merge_heads(out))


class GQARotatingByADefault(GQARotatingThroughAWrapper):
    def forward(self, x, cache=None, rotate=apply_rotary):
        start = 0 if cache is None else cache.length
        q = rotate(split_heads(self.query(x), self.num_heads), self.rope_cos, self.rope_sin, offset=start)
        k = rotate(split_heads(self.key(x), self.num_kv_heads), self.rope_cos, self.rope_sin, offset=start)
        v = split_heads(self.value(x), self.num_kv_heads)
        if cache is not None:
            k, v = cache.append(k, v)
        mask = causal_mask(k.shape[2])[start:].to(x.device)
        out = F.scaled_dot_product_attention(q, repeat_kv(k, self.groups), repeat_kv(v, self.groups), attn_mask=mask)
        return self.proj(merge_heads(out))
"""
_cell = dict(torch=torch, F=F, GroupedQueryAttention=GroupedQueryAttention, split_heads=split_heads,
             merge_heads=merge_heads, repeat_kv=repeat_kv, causal_mask=causal_mask,
             rotary_interleaved_pairs=rotary_interleaved_pairs)
exec(compile(_THROUGH_HELPERS, "<your 09_modern_attention.ipynb, Exercise 9.6>", "exec"), _cell)
bug("9.6", "rope_layout", "exercise 9.2", "check_apply_rotary")(_cell["GQARotatingThroughAWrapper"])
bug("9.6", "rope_layout", "exercise 9.2", "check_apply_rotary")(_cell["GQARotatingByADefault"])
