"""Round 35c (notebook 04): slips the checks of TransformerBlock.forward (4.2) and GPT.forward (4.3) let through.

4.2: a block that mixes positions outside self.attn behind a LayerNorm (a mean, a reversed cumsum or a roll along
the sequence of ln1(x) or ln2(x), attention written by hand with torch.tril(..., diagonal=1)) got ``mismatch``, and a
small leak ``precision``: the future-leak probe shifted the last position by a constant, which a LayerNorm removes.
It now adds random noise (a fixed draw) to the last position, then to positions k.. for k down to 1, before the
rounding's size is judged: ``causal_mask``, an earlier position's output changed when only a later one changed.
4.3's probe (another token, which no LayerNorm removes) changed the last token only: a leak that stops short of
the end (neighbours pooled in pairs, a lone last token kept) got ``mismatch``; it now changes positions k.. too.

4.2 and 4.3: code right for a batch of one only (the first sequence's feed-forward or embeddings broadcast over the
batch, x[0] for x[:1], a mean over the batch axis) got ``mismatch``. Once the batch's output is wrong, each
sequence is run alone: right alone and wrong together is ``batch_mixing`` (``engine.probes.batch_mixing``), every
row equal to row 0's output named as row 0's work copied over the batch.

4.2 and 4.3: an output made on the CPU whatever the input's device (torch.zeros(x.shape) without device=, a
torch.ones(E) scale, .cpu() on the result) passed: the checks now end with the engine's module device probe
(``_device_probe.probe_module``, the GPT with integer ids on meta): ``device``. A buffer made with zeros_like,
new_zeros or device=x.device stays right.

4.2: ln2 applied to the feed-forward's input and again to the block's output got ``residual``; it is a listed
``norm_placement`` now. 4.3: a forward that reads the learned table (self.position_encoding.embedding(arange))
raised IndexError on too long an idx and got ``context_limit`` before the sinusoidal config was built; a GPT that
raises anything but a ValueError there now meets the other parts first: ``exception``, "sinusoidal positions",
saying the positions come from self.position_encoding(L, start) whatever the config.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from bank.attempts import new_bank
from course_lib.attention import MultiHeadMaskedAttention
from course_lib.model import FeedForward, LearnedPositionalEncoding, SinusoidalPositionalEncoding
from course_lib.model import TransformerBlock as _CourseBlock

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 4.2 TransformerBlock.forward

class _Block(nn.Module):
    """The constructor the notebook gives."""

    def __init__(self, embed_dim, num_heads, max_tokens, dropout_rate=0.0, norm_first=True):
        super().__init__()
        self.norm_first = norm_first
        self.ln1 = nn.LayerNorm(embed_dim)
        self.attn = MultiHeadMaskedAttention(embed_dim, num_heads, max_tokens, dropout_rate)
        self.ln2 = nn.LayerNorm(embed_dim)
        self.mlp = FeedForward(embed_dim, 4 * embed_dim, dropout_rate)


def _attention_by_hand(attn, h, diagonal):
    """self.attn's computation written out with its own weights, the mask torch.tril(..., diagonal=diagonal)."""
    n, length, e = h.shape
    heads = attn.num_heads

    def split(t):
        return t.view(n, length, heads, e // heads).transpose(1, 2)            # (N, H, L, d)
    q, k, v = split(attn.query(h)), split(attn.key(h)), split(attn.value(h))
    scores = q @ k.transpose(-2, -1) / math.sqrt(e // heads)                 # (N, H, L, L)
    allowed = torch.tril(torch.ones(length, length, dtype=torch.bool, device=h.device), diagonal=diagonal)
    weights = attn.attn_dropout(scores.masked_fill(~allowed, float("-inf")).softmax(-1))
    out = (weights @ v).transpose(1, 2).reshape(n, length, e)               # (N, L, E)
    return attn.proj_dropout(attn.proj(out))


# ---------------------------------------------------------------- right, near the wrong ones below

@correct("4.2")
class BlockHandAttentionTril0(_Block):
    """Right: self.attn written out by hand with its weights, the mask torch.tril(ones, diagonal=0)."""

    def forward(self, x):
        x = x + _attention_by_hand(self.attn, self.ln1(x), 0)
        return x + self.mlp(self.ln2(x))


@correct("4.2")
class BlockLayerNormByHand(_Block):
    """Right: each LayerNorm by hand, a mean and a variance over the features (dim -1), never over the sequence."""

    def _norm(self, ln, t):
        mean = t.mean(-1, keepdim=True)
        var = t.var(-1, keepdim=True, unbiased=False)
        return (t - mean) / torch.sqrt(var + ln.eps) * ln.weight + ln.bias

    def forward(self, x):
        if self.norm_first:
            x = x + self.attn(self._norm(self.ln1, x))
            return x + self.mlp(self._norm(self.ln2, x))
        x = self._norm(self.ln1, x + self.attn(x))
        return self._norm(self.ln2, x + self.mlp(x))


@correct("4.2", norm_first=False)
class BlockLayerNormByHandPostNorm(BlockLayerNormByHand):
    """Right: the same LayerNorms by hand, checked as the post-norm block (one attempt's name per option)."""


@correct("4.2")
class BlockZerosLikeBuffer(_Block):
    """Right: the output buffer made with torch.zeros_like(x), on x's device, then filled."""

    def forward(self, x):
        out = torch.zeros_like(x)
        h = x + self.attn(self.ln1(x))
        out.copy_(h + self.mlp(self.ln2(h)))
        return out


@correct("4.2")
class BlockNewZerosBuffer(_Block):
    """Right: the output buffer made with x.new_zeros(x.shape) (x's device and dtype), filled by slice assignment."""

    def forward(self, x):
        out = x.new_zeros(x.shape)
        h = x + self.attn(self.ln1(x))
        out[:] = h + self.mlp(self.ln2(h))
        return out


# ---------------------------------------------------------------- wrong: the future leaks behind a LayerNorm

@bug("4.2", "causal_mask", "future", "earlier position")
class BlockMlpMixesPositions(_Block):
    """Wrong (the tester's): the feed-forward input gets the mean over ALL positions added (the future included)."""

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        return x + self.mlp(h + h.mean(1, keepdim=True))


@bug("4.2", "causal_mask", "future", "earlier position")
class BlockMlpReversedCumsum(_Block):
    """Wrong: a 'context' of the positions from here to the end (a cumsum of the flipped sequence) into the MLP."""

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        ahead = h.flip(1).cumsum(1).flip(1) / h.shape[1]                       # position i: the sum of i .. L-1
        return x + self.mlp(h + ahead)


@bug("4.2", "causal_mask", "future", "earlier position")
class BlockAttnInputRolled(_Block):
    """Wrong: the attention's input gets the next position's normalised vector (torch.roll by -1 along L)."""

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h + 0.5 * torch.roll(h, -1, dims=1))
        return x + self.mlp(self.ln2(x))


@bug("4.2", "causal_mask", "future", "earlier position")
class BlockHandAttentionTril1(_Block):
    """Wrong: attention by hand with torch.tril(ones, diagonal=1): position i also sees position i + 1."""

    def forward(self, x):
        x = x + _attention_by_hand(self.attn, self.ln1(x), 1)
        return x + self.mlp(self.ln2(x))


@bug("4.2", "causal_mask", "future", avoids=("half precision",))
class BlockSmallLeakBehindNorm(_Block):
    """Wrong: a small share (0.2%) of the next position's normalised vector in the MLP's input: once 'precision'."""

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        return x + self.mlp(h + 0.002 * torch.roll(h, -1, dims=1))


@bug("4.2", "causal_mask", "future", "positions 3 to 4")
class BlockPairsPooled(_Block):
    """Wrong: the MLP's input pooled over pairs of neighbours (0 with 1, 2 with 3, a lone last position kept): the
    last position leaks nowhere, an earlier one does (the old probe changed the last position only)."""

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        length = h.shape[1]
        pooled = h.clone()
        pooled[:, 0:length - 1:2] = (h[:, 0:length - 1:2] + h[:, 1:length:2]) / 2
        return x + self.mlp(pooled)


# ---------------------------------------------------------------- wrong: right for a batch of one only

@bug("4.2", "batch_mixing", "batch of one", "sequence 1")
class BlockFirstSequenceMlp(_Block):
    """Wrong (the tester's): the feed-forward of sequence 0 broadcast over the batch (right for batch 1 only)."""

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x[:1]))


@bug("4.2", "batch_mixing", "batch of one", "x[0]")
class BlockMlpOfRowZero(_Block):
    """Wrong: the feed-forward's output indexed [0] (meant for a batch of one), broadcast over the batch."""

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))[0]


@bug("4.2", "batch_mixing", "batch of one", "across the batch")
class BlockAttnAveragedOverBatch(_Block):
    """Wrong: the attention's update averaged over the batch axis (dim 0), the same for every sequence."""

    def forward(self, x):
        x = x + self.attn(self.ln1(x)).mean(0, keepdim=True)
        return x + self.mlp(self.ln2(x))


# ---------------------------------------------------------------- wrong: an output on the CPU

@bug("4.2", "device", "device=x.device")
class BlockCpuBuffer(_Block):
    """Wrong (the tester's): the output buffer made with torch.zeros(x.shape, dtype=x.dtype): on the CPU."""

    def forward(self, x):
        out = torch.zeros(x.shape, dtype=x.dtype)
        h = x + self.attn(self.ln1(x))
        out.copy_(h + self.mlp(self.ln2(h)))
        return out


@bug("4.2", "device", "device=x.device")
class BlockCpuOnesGate(_Block):
    """Wrong: a gate of ones on the attention's update, torch.ones(E, dtype=x.dtype) without device=."""

    def forward(self, x):
        gate = torch.ones(x.shape[-1], dtype=x.dtype)
        x = x + gate * self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


@bug("4.2", "device", ".cpu()")
class BlockReturnsCpu(_Block):
    """Wrong: the result moved with .cpu() (to print or plot it), a no-op on a CPU machine."""

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return (x + self.mlp(self.ln2(x))).cpu()


# ---------------------------------------------------------------- wrong: ln2 twice

@bug("4.2", "norm_placement", "ln2", "twice")
class BlockNormOnOutput(_Block):
    """Wrong (the tester's): a pre-norm block, then ln2 applied again to its output (a final LayerNorm)."""

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return self.ln2(x)


@bug("4.2", "norm_placement", "ln2", "twice")
class BlockNormOnOutputFunctional(_Block):
    """Wrong: the same with the output normalised by F.layer_norm with ln2's own weight and bias."""

    def forward(self, x):
        h = x + self.attn(self.ln1(x))
        out = h + self.mlp(self.ln2(h))
        return F.layer_norm(out, out.shape[-1:], self.ln2.weight, self.ln2.bias, self.ln2.eps)


# ============================================================================ 4.3 GPT.forward

class _GPT(nn.Module):
    """The constructor the notebook gives (the blocks are the course's)."""

    def __init__(self, config):
        super().__init__()
        c = self.config = config
        self.token_embedding = nn.Embedding(c.vocab_size, c.embed_dim)
        positions = LearnedPositionalEncoding if c.positional == "learned" else SinusoidalPositionalEncoding
        self.position_encoding = positions(c.max_tokens, c.embed_dim)
        self.dropout = nn.Dropout(c.dropout_rate)
        self.blocks = nn.ModuleList(
            _CourseBlock(c.embed_dim, c.num_heads, c.max_tokens, c.dropout_rate, c.norm_first)
            for _ in range(c.num_layers))
        self.ln_f = nn.LayerNorm(c.embed_dim)
        self.head = nn.Linear(c.embed_dim, c.vocab_size, bias=False)

    def _rest(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ---------------------------------------------------------------- right, near the wrong ones below

@correct("4.3")
class GPTZerosOnIdxDevice(_GPT):
    """Right: the embeddings summed into torch.zeros(..., device=idx.device) of the head's dtype."""

    def forward(self, idx):
        n, length = idx.shape
        x = torch.zeros(n, length, self.config.embed_dim, dtype=self.head.weight.dtype, device=idx.device)
        x = x + self.token_embedding(idx) + self.position_encoding(length)
        return self._rest(self.dropout(x))


@correct("4.3")
class GPTRowByRow(_GPT):
    """Right: one sequence at a time (idx[i:i + 1]), the logits stacked back into a batch."""

    def forward(self, idx):
        rows = []
        for i in range(idx.shape[0]):
            one = idx[i:i + 1]                                                   # (1, L)
            x = self.dropout(self.token_embedding(one) + self.position_encoding(one.shape[1]))
            rows.append(self._rest(x))
        return torch.cat(rows)                                                   # (N, L, V)


@correct("4.3")
class GPTPositionsWithStart(_GPT):
    """Right: self.position_encoding(L, 0), the start given, whatever kind the config chose."""

    def forward(self, idx):
        x = self.token_embedding(idx) + self.position_encoding(idx.shape[1], 0)
        return self._rest(self.dropout(x))


@bug("4.3", "causal_mask", "future", "earlier position")
class GPTTokenPairsPooled(_GPT):
    """Wrong: the token embeddings pooled over pairs of neighbours (0 with 1, 2 with 3; a lone last token kept): with
    5 tokens the last token leaks nowhere, token 3 does (the old probe changed the last token only)."""

    def forward(self, idx):
        tok = self.token_embedding(idx)
        length = tok.shape[1]
        pooled = tok.clone()
        pooled[:, 0:length - 1:2] = (tok[:, 0:length - 1:2] + tok[:, 1:length:2]) / 2
        return self._rest(self.dropout(pooled + self.position_encoding(length)))


# ---------------------------------------------------------------- wrong: right for a batch of one only

@bug("4.3", "batch_mixing", "batch of one", "FIRST sequence")
class GPTFirstRowOnly(_GPT):
    """Wrong (the tester's): the embeddings of the first sequence expanded over the batch."""

    def forward(self, idx):
        x = self.dropout(self.token_embedding(idx[:1]) + self.position_encoding(idx.shape[1]))
        return self._rest(x.expand(idx.shape[0], -1, -1))


@bug("4.3", "batch_mixing", "batch of one", "FIRST sequence")
class GPTLoopOnFirstRow(_GPT):
    """Wrong: a loop over the sequences that takes idx[:1] where idx[i:i + 1] is meant."""

    def forward(self, idx):
        rows = []
        for _ in range(idx.shape[0]):
            one = idx[:1]
            x = self.dropout(self.token_embedding(one) + self.position_encoding(one.shape[1]))
            rows.append(self._rest(x))
        return torch.cat(rows)


@bug("4.3", "batch_mixing", "batch of one", "across the batch")
class GPTEmbeddingsAveragedOverBatch(_GPT):
    """Wrong: the token embeddings averaged over dim 0, the batch axis, and the mean given to every sequence."""

    def forward(self, idx):
        tok = self.token_embedding(idx).mean(0, keepdim=True).expand(idx.shape[0], -1, -1)   # (N, L, E)
        return self._rest(self.dropout(tok + self.position_encoding(idx.shape[1])))


# ---------------------------------------------------------------- wrong: an output on the CPU

@bug("4.3", "device", "device=x.device")
class GPTPositionsOnCpu(_GPT):
    """Wrong (the tester's): the embeddings added into a torch.zeros buffer made on the CPU."""

    def forward(self, idx):
        n, length = idx.shape
        x = torch.zeros(n, length, self.config.embed_dim, dtype=self.head.weight.dtype)
        x += self.token_embedding(idx) + self.position_encoding(length)
        return self._rest(self.dropout(x))


@bug("4.3", "device", ".cpu()")
class GPTLogitsToCpu(_GPT):
    """Wrong: the logits moved with .cpu() before they are returned."""

    def forward(self, idx):
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(idx.shape[1]))
        return self._rest(x).cpu()


@bug("4.3", "device", "device=x.device")
class GPTCpuScale(_GPT):
    """Wrong: the embeddings scaled by a tensor of ones made on the CPU (torch.ones(E))."""

    def forward(self, idx):
        scale = torch.ones(self.config.embed_dim, dtype=self.head.weight.dtype)
        x = self.token_embedding(idx) * scale + self.position_encoding(idx.shape[1])
        return self._rest(self.dropout(x))


# ---------------------------------------------------------------- wrong: one kind of position encoding read

@bug("4.3", "exception", "sinusoidal positions", "self.position_encoding(L, start)")
class GPTReachesIntoLearnedTable(_GPT):
    """Wrong (the tester's): positions from self.position_encoding.embedding(arange), the learned kind's inside:
    too long an idx raises IndexError there, once named context_limit before the sinusoidal config ran."""

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.dropout(self.token_embedding(idx) + self.position_encoding.embedding(pos))
        return self._rest(x)


@bug("4.3", "exception", "sinusoidal positions", "self.position_encoding(L, start)")
class GPTLearnedWeightIndexed(_GPT):
    """Wrong: positions as self.position_encoding.embedding.weight[arange(L)]: IndexError past the table."""

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.token_embedding(idx) + self.position_encoding.embedding.weight[pos]
        return self._rest(self.dropout(x))
