"""Round 32s (the r32a tester's notebooks 02-04): sizes and rates written into the code, the batch confused with the
length, and coarse or integer arithmetic in the position table.

2.1: a mask cut from a fixed n x n one passed every case (all 13 or smaller); now causal_mask(1100), past every
context of the course, names the size written in. 2.2, 3.3: dropout at a fixed rate was told "your weights are
changed, not just dropped"; now the share dropped is measured and named beside the constructor's dropout_rate.
4.3: a fixed rate of 0.1 passed, the check's own rate; the training probe now runs at 0.2 and names the rate.
3.1, 3.2: a reshape that mixes the sequences of the batch was "head_split"; now ``batch_mixing``, and code written
for a batch of one is named as such instead of a raw exception. 4.1: every frequency 1 (two_i // embed_dim) and
angles rounded in float16 or bfloat16 are named. 4.2 post-norm: one step that adds the sublayer to the normalised
input (ln2(x) + mlp(x)), the sum never normalised, is ``norm_placement``. 4.3: the length taken from idx.shape[0]
(or len(idx)) is ``positions``.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from bank.attempts import new_bank
from course_lib.attention import MaskedAttention, MultiHeadMaskedAttention, merge_heads, split_heads
from course_lib.model import GPT, FeedForward

BUGGY, CORRECT, bug, correct = new_bank()

# ============================================================================ 2.1 a size written into the mask


@bug("2.1", "shape", "n", "16")
def mask_hardcoded_16(n):
    """Cut from a fixed 16 x 16 mask: right for n <= 16, too small beyond."""
    return torch.ones(16, 16, dtype=torch.bool).tril()[:n, :n]


@bug("2.1", "shape", "n", "64")
def mask_hardcoded_64(n):
    """Cut from a fixed 64 x 64 mask (the notebook's context): right for n <= 64, fails beyond."""
    return torch.ones(64, 64, dtype=torch.bool).tril()[:n, :n]


_BIG_MASK = torch.tril(torch.ones(1024, 1024)).bool()   # GPT-2's context, built once


@bug("2.1", "shape", "n", "1024")
def mask_sliced_from_global_1024(n):
    """A 1024 x 1024 mask made once at import, sliced: right up to GPT-2's context only."""
    return _BIG_MASK[:n, :n].clone()


@bug("2.1", "shape", "n", "256")
def mask_view_of_fixed_256(n):
    """torch.tril of a fixed 256 x 256, then a view of n*n entries: raises past 256."""
    return torch.tril(torch.ones(256, 256, dtype=torch.bool))[:n, :n].reshape(n * n).view(n, n)


@correct("2.1")
def mask_tril_indices(n):
    mask = torch.zeros(n, n, dtype=torch.bool)
    rows, cols = torch.tril_indices(n, n)
    mask[rows, cols] = True
    return mask


@correct("2.1")
def mask_row_by_row(n):
    """One row at a time: slow for a long n, but right."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        mask[i, :i + 1] = True
    return mask


# ============================================================================ 2.2 / 3.3 dropout at a fixed rate


class _Masked(MaskedAttention):
    def weights(self, x):
        length = x.shape[1]
        q, k = self.query(x), self.key(x)
        scores = q @ k.transpose(-2, -1) / self.embed_dim ** 0.5
        return scores.masked_fill(~self.mask[:length, :length], float("-inf")).softmax(-1)


@bug("2.2", "dropout", "10%", "20%", "dropout_rate", avoids=("before the softmax",))
class MaskedHardcodedDropout(_Masked):
    """F.dropout(weights, 0.1, self.training): a fixed rate where self.attn_dropout (the constructor's rate) is meant."""

    def forward(self, x):
        out = self.proj(F.dropout(self.weights(x), 0.1, self.training) @ self.value(x))
        return F.dropout(out, 0.1, self.training)


@bug("2.2", "dropout", "attention weights", "10%", "dropout_rate", avoids=("before the softmax",))
class MaskedOwnAttnDropout(_Masked):
    """An nn.Dropout(0.1) of its own on the weights; the output's dropout is the given one."""

    def __init__(self, embed_dim, max_tokens, dropout_rate=0.0):
        super().__init__(embed_dim, max_tokens, dropout_rate)
        self.weights_dropout = nn.Dropout(0.1)

    def forward(self, x):
        return self.proj_dropout(self.proj(self.weights_dropout(self.weights(x)) @ self.value(x)))


@bug("2.2", "dropout", "50%", "dropout_rate", avoids=("before the softmax",))
class MaskedHalfDropout(_Masked):
    """Dropout at 0.5 on both, the usual default of a textbook."""

    def forward(self, x):
        out = self.proj(F.dropout(self.weights(x), 0.5, self.training) @ self.value(x))
        return F.dropout(out, p=0.5, training=self.training)


@correct("2.2")
class MaskedFunctionalDropoutFromModules(_Masked):
    """F.dropout with the rate read from the given layers: the same as calling them."""

    def forward(self, x):
        weights = F.dropout(self.weights(x), self.attn_dropout.p, self.training)
        return F.dropout(self.proj(weights @ self.value(x)), self.proj_dropout.p, self.training)


class _Multi(MultiHeadMaskedAttention):
    def heads_out(self, x, attn_dropout):
        length = x.shape[1]
        q, k, v = (split_heads(t, self.num_heads) for t in (self.query(x), self.key(x), self.value(x)))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        weights = scores.masked_fill(~self.mask[:length, :length], float("-inf")).softmax(-1)
        return merge_heads(attn_dropout(weights) @ v)


@bug("3.3", "dropout", "10%", "20%", "dropout_rate", avoids=("before the softmax",))
class MultiHardcodedDropout(_Multi):
    """nn.Dropout(0.1) modules of its own: a fixed rate where the constructor's dropout_rate is meant."""

    def __init__(self, embed_dim, num_heads, max_tokens, dropout_rate=0.0):
        super().__init__(embed_dim, num_heads, max_tokens, dropout_rate)
        self.attn_dropout = nn.Dropout(0.1)
        self.proj_dropout = nn.Dropout(0.1)

    def forward(self, x):
        return self.proj_dropout(self.proj(self.heads_out(x, self.attn_dropout)))


@bug("3.3", "dropout", "output", "10%", "dropout_rate", avoids=("before the softmax",))
class MultiFixedProjDropout(_Multi):
    """The weights' dropout is the given one; the output's is F.dropout at a fixed 0.1."""

    def forward(self, x):
        return F.dropout(self.proj(self.heads_out(x, self.attn_dropout)), 0.1, self.training)


@correct("3.3")
class MultiFunctionalDropoutAtTheLayersRates(_Multi):
    """F.dropout at the layers' own rate, training=self.training."""

    def forward(self, x):
        out = self.heads_out(x, lambda w: F.dropout(w, p=self.attn_dropout.p, training=self.training))
        return F.dropout(self.proj(out), p=self.proj_dropout.p, training=self.training)


# ============================================================================ 4.3 dropout at a fixed rate


@bug("4.3", "dropout", "0.1", "config.dropout_rate")
class GPTHardcodedDropout(GPT):
    """F.dropout(x, 0.1, self.training): a fixed rate instead of the config's."""

    def forward(self, idx):
        x = F.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]), 0.1, self.training)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@bug("4.3", "dropout", "0.1", "config.dropout_rate")
class GPTOwnDropoutLayer(GPT):
    """Replaces the given self.dropout with nn.Dropout(0.1) in the constructor."""

    def __init__(self, config):
        super().__init__(config)
        self.dropout = nn.Dropout(0.1)

    def forward(self, idx):
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@correct("4.3")
class GPTFunctionalDropoutOfConfig(GPT):
    """F.dropout with the config's rate and training=self.training: the same as self.dropout."""

    def forward(self, idx):
        x = self.token_embedding(idx) + self.position_encoding(idx.shape[1])
        x = F.dropout(x, self.config.dropout_rate, self.training)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ============================================================================ 3.1 / 3.2 the batch mixed or assumed one


@bug("3.1", "batch_mixing", "batch", avoids=("Head h should",))
def split_flattens_batch_into_positions(x, num_heads):
    """Views (N*L, H, hd), transposes, then reshapes to (N, H, L, hd): positions of different sequences mixed."""
    n, length, embed_dim = x.shape
    y = x.reshape(n * length, num_heads, embed_dim // num_heads).transpose(0, 1)   # (H, N*L, hd)
    return y.reshape(n, num_heads, length, embed_dim // num_heads)


@bug("3.1", "batch_mixing", "batch", avoids=("Head h should",))
def split_reshape_length_first(x, num_heads):
    """reshape(L, N, H, hd) of an (N, L, E) tensor, as if it were sequence-first, then permuted back."""
    n, length, embed_dim = x.shape
    return x.reshape(length, n, num_heads, embed_dim // num_heads).permute(1, 2, 0, 3)


@bug("3.2", "batch_mixing", "batch", avoids=("Position l of",))
def merge_reshape_length_first(x):
    """transpose(1, 2) then reshape(L, N, E), transposed back: the sequences of the batch mixed."""
    n, heads, length, head_dim = x.shape
    return x.transpose(1, 2).reshape(length, n, heads * head_dim).transpose(0, 1)


@bug("3.1", "shape", "batch of one")
def split_batch_of_one(x, num_heads):
    """squeeze(0) / unsqueeze(0): written for a batch of one."""
    length, embed_dim = x.shape[-2:]
    y = x.squeeze(0).view(length, num_heads, embed_dim // num_heads).transpose(0, 1)
    return y.unsqueeze(0)


@bug("3.1", "shape", "batch of one")
def split_first_sequence_only(x, num_heads):
    """x[0] ... [None]: the first sequence alone, so a batch of N comes back as a batch of one."""
    length, embed_dim = x.shape[1:]
    return x[0].view(length, num_heads, embed_dim // num_heads).transpose(0, 1)[None]


@bug("3.2", "shape", "batch of one")
def merge_batch_of_one(x):
    """x[0].transpose(0, 1).reshape(1, L, E): written for a batch of one."""
    heads, length, head_dim = x.shape[1:]
    return x[0].transpose(0, 1).reshape(1, length, heads * head_dim)


@correct("3.1")
def split_unflatten_movedim(x, num_heads):
    return x.unflatten(-1, (num_heads, x.shape[-1] // num_heads)).movedim(-2, 1)


@correct("3.2")
def merge_movedim_flatten(x):
    return x.movedim(1, -2).flatten(-2)


# ============================================================================ 4.1 the angles: integer or coarse


@bug("4.1", "scale", "frequency is 1", "2i / embed_dim", "integer division")
def table_integer_division(max_tokens, embed_dim):
    """two_i // embed_dim (floor division on integer tensors): every exponent 0, every frequency 1."""
    position = torch.arange(max_tokens)[:, None]
    two_i = torch.arange(0, embed_dim, 2)
    angles = position / 10000 ** (two_i // embed_dim)
    table = torch.zeros(max_tokens, embed_dim)
    table[:, 0::2], table[:, 1::2] = torch.sin(angles), torch.cos(angles)
    return table


@bug("4.1", "scale", "frequency is 1", "integer division")
def table_exponent_cast_to_int(max_tokens, embed_dim):
    """(2i / embed_dim).long(): the exponent cut to 0, every frequency 1 (concatenated halves too)."""
    position = torch.arange(max_tokens, dtype=torch.float32)[:, None]
    exponent = (torch.arange(0, embed_dim, 2) / embed_dim).long()
    angles = position / 10000.0 ** exponent
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)


@bug("4.1", "precision", "float16", "float32")
def table_angles_in_half(max_tokens, embed_dim):
    """Angles computed in float16 to save memory: rounded coarsely from position ~35 on."""
    position = torch.arange(max_tokens, dtype=torch.float16)[:, None]
    frequency = (1.0 / 10000 ** (torch.arange(0, embed_dim, 2, dtype=torch.float32) / embed_dim)).half()
    angles = position * frequency
    table = torch.zeros(max_tokens, embed_dim)
    table[:, 0::2], table[:, 1::2] = torch.sin(angles).float(), torch.cos(angles).float()
    return table


@bug("4.1", "precision", "float32")
def table_angles_cast_to_bfloat16(max_tokens, embed_dim):
    """Angles right in float32, cast to bfloat16 before sin and cos."""
    position = torch.arange(max_tokens, dtype=torch.float32)[:, None]
    angles = (position * 10000.0 ** (-torch.arange(0, embed_dim, 2) / embed_dim)).bfloat16()
    table = torch.empty(max_tokens, embed_dim)
    table[:, 0::2], table[:, 1::2] = angles.sin().float(), angles.cos().float()
    return table


@correct("4.1")
def table_float64_angles(max_tokens, embed_dim):
    """Angles in float64, the table returned in float32."""
    angles = torch.arange(max_tokens, dtype=torch.float64)[:, None] / 10000 ** (
        torch.arange(0, embed_dim, 2, dtype=torch.float64) / embed_dim)
    return torch.stack([angles.sin(), angles.cos()], -1).flatten(1).float()


# ============================================================================ 4.2 post-norm: one sum never normalised


class _Block(nn.Module):
    def __init__(self, embed_dim, num_heads, max_tokens, dropout_rate=0.0, norm_first=True):
        super().__init__()
        self.norm_first = norm_first
        self.ln1 = nn.LayerNorm(embed_dim)
        self.attn = MultiHeadMaskedAttention(embed_dim, num_heads, max_tokens, dropout_rate)
        self.ln2 = nn.LayerNorm(embed_dim)
        self.mlp = FeedForward(embed_dim, 4 * embed_dim, dropout_rate)


@bug("4.2", "norm_placement", "ln2", "normalised", norm_first=False)
class BlockPostNormResidualFromNormed(_Block):
    """Post-norm whose second step is ln2(x) + mlp(x): the norm on the residual alone, the sum never normalised."""

    def forward(self, x):
        if self.norm_first:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.attn(x))
        return self.ln2(x) + self.mlp(x)


@bug("4.2", "norm_placement", "ln2", "normalised", norm_first=False)
class BlockPostNormSecondStepPreNormed(_Block):
    """Second step x = ln2(x); x + mlp(x): normalised before the feed-forward, the sum left as it is."""

    def forward(self, x):
        if self.norm_first:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.attn(x))
        x = self.ln2(x)
        return x + self.mlp(x)


@bug("4.2", "norm_placement", "ln1", "normalised", norm_first=False)
class BlockPostNormFirstStepFromNormed(_Block):
    """First step ln1(x) + attn(x), the second one right."""

    def forward(self, x):
        if self.norm_first:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x) + self.attn(x)
        return self.ln2(x + self.mlp(x))


@correct("4.2", norm_first=False)
class BlockPostNormNamedSteps(_Block):
    def forward(self, x):
        if self.norm_first:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        after_attention = self.ln1(torch.add(x, self.attn(x)))
        return self.ln2(torch.add(after_attention, self.mlp(after_attention)))


# ============================================================================ 4.3 the length from the batch axis


@bug("4.3", "positions", "idx.shape[1]", "batch")
class GPTPositionsOfBatch(GPT):
    """position_encoding(idx.shape[0]): the batch size where the length is meant."""

    def forward(self, idx):
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[0]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@bug("4.3", "positions", "idx.shape[1]", "batch")
class GPTPositionsOfLen(GPT):
    """position_encoding(len(idx)): len of a tensor is its first axis, the batch."""

    def forward(self, idx):
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(len(idx)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@bug("4.3", "positions", "idx.shape[1]", "batch")
class GPTShapeUnpackedSwapped(GPT):
    """length, n = idx.shape (sequence-first habit): the length is the batch size."""

    def forward(self, idx):
        length, n = idx.shape
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(length)[None])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


@correct("4.3")
class GPTPositionsOfSize(GPT):
    def forward(self, idx):
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.size(-1)).unsqueeze(0))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
