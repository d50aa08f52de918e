"""Round 41a (notebooks 01-04, 07, 09, 10, 12): attempts at 1.1, 1.2, 2.2, 3.3, 4.2, 4.3, 7.1, 7.2, 9.3, 9.4, 10.3,
12.1, 12.3; two slips in one attempt, right but unusual formulations, axes of size one.

Named by this round's fixes: 7.2 with fewer queries than keys AND a mask given (a cached step of generate() with
padding): a mask ignored for one query, or combined with a causal mask aligned top-left (``causal_mask``); a
.squeeze() that drops an axis of size one the text allows: 1.2 with d = 1 (``exception``), 12.3 with d_v = 1
(``shape``); 9.3 on one vector (dim,) (``norm_statistic``). Left out: 2.2 skipping attn_dropout for one token,
which shows only in training mode on one token.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from bank.attempts import Attempt, new_bank
from course_lib import flash
from course_lib.attention import MultiHeadMaskedAttention as _CourseMHA
from course_lib.attention import causal_mask, merge_heads, scaled_dot_product_attention, split_heads
from course_lib.model import FeedForward, LearnedPositionalEncoding, SinusoidalPositionalEncoding
from course_lib.model import TransformerBlock as _CourseBlock

BUGGY, CORRECT, bug, correct = new_bank()


# ============================================================================ 4.2 TransformerBlock

class _Given04(nn.Module):
    def __init__(self, embed_dim, num_heads, max_tokens, dropout_rate=0.0, norm_first=True):
        super().__init__()
        self.norm_first = norm_first
        self.ln1 = nn.LayerNorm(embed_dim)
        self.attn = _CourseMHA(embed_dim, num_heads, max_tokens, dropout_rate)
        self.ln2 = nn.LayerNorm(embed_dim)
        self.mlp = FeedForward(embed_dim, 4 * embed_dim, dropout_rate)


@bug("4.2", "kept_state")
class BlockMemoisesEvalOutputsByShapeAndDevice(_Given04):
    """Wrong: in eval mode the block's output is memoised per (shape, dtype, device), 'for fast generation':
    a new x of a shape seen before gets the old x's output."""

    def forward(self, x):
        key = (tuple(x.shape), x.dtype, x.device)
        memo = self.__dict__.setdefault("_memo", {})
        if not self.training and key in memo:
            return memo[key]
        if self.norm_first:
            y = x + self.attn(self.ln1(x))
            y = y + self.mlp(self.ln2(y))
        else:
            y = self.ln1(x + self.attn(x))
            y = self.ln2(y + self.mlp(y))
        if not self.training:
            memo[key] = y
        return y


# ============================================================================ 4.3 GPT

class _GPT(nn.Module):
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


@bug("4.3", "kept_state")
class GPTMemoisesEvalLogitsByShape(_GPT):
    """Wrong: eval-mode logits memoised per (shape, device) of idx: new tokens of a seen shape get old logits."""

    def forward(self, idx):
        key = (tuple(idx.shape), idx.device)
        memo = self.__dict__.setdefault("_memo", {})
        if not self.training and key in memo:
            return memo[key]
        length = idx.shape[1]
        if length > self.config.max_tokens:
            raise ValueError(f"idx has {length} tokens, more than max_tokens={self.config.max_tokens}: crop it")
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(length))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if not self.training:
            memo[key] = logits
        return logits


# ============================================================================ 1.1 my_prediction

_E = math.e
# the weights sorted from largest to smallest, not in the order of TOY_KEYS
BUGGY.append(Attempt("1.1", "prediction_sorted_largest_first", ([0.58, 0.21, 0.21], 2.0), "mismatch", ("order",)))
# the query [0, -1] (pointing down) by mistake: weights [0.42, 0.16, 0.42], and by symmetry the result is still 2
BUGGY.append(Attempt("1.1", "prediction_for_the_query_pointing_down",
                     ([1 / (2 + 1 / _E), (1 / _E) / (2 + 1 / _E), 1 / (2 + 1 / _E)], 2.0), "mismatch"))
# two slips: the exps not divided by their sum, and the result from those raw exps
BUGGY.append(Attempt("1.1", "prediction_exps_unnormalised_and_their_result",
                     ([1.0, 2.72, 1.0], 1.0 + 2 * 2.72 + 3.0), "normalization", ("sum",)))
# a list of one-element tensors and a (1, 1) tensor for the result
CORRECT.append(Attempt("1.1", "prediction_list_of_one_element_tensors",
                       ([torch.tensor([0.2119]), torch.tensor([0.5761]), torch.tensor([0.2119])],
                        torch.tensor([[2.0]])), None))
# a (3, 1) column, exact, and a Python int for the result
CORRECT.append(Attempt("1.1", "prediction_column_and_int_result",
                       (torch.tensor([[1.0], [_E], [1.0]]) / (_E + 2), 2), None))


# ============================================================================ 1.2 toy_attention

@correct("1.2")
def toy_vmap_dot_and_einsum_ellipsis(query, keys, values):
    """Right: torch.func.vmap of a dot product over the keys, then an einsum with an ellipsis for (n,) or (n, dv)."""
    scores = torch.func.vmap(torch.dot, in_dims=(0, None))(keys, query)   # (n,)
    weights = torch.softmax(scores, dim=0)
    return torch.einsum("n,n...->...", weights, values)


@correct("1.2")
def toy_float64_inside_cast_back(query, keys, values):
    """Right: everything in float64, the result cast back to the values' dtype."""
    w = torch.softmax(keys.double() @ query.double(), dim=0)
    return (w @ values.double()).to(values.dtype)


@correct("1.2")
def toy_in_place_shift_on_fresh_scores(query, keys, values):
    """Right: the maximum (taken without a graph) subtracted in place from the fresh scores, then softmin of -s."""
    scores = keys @ query
    with torch.no_grad():
        top = scores.max()
    scores.sub_(top)
    weights = F.softmin(-scores, dim=0)
    return weights @ values


@bug("1.2", "exception")
def toy_query_squeezed_for_row_queries(query, keys, values):
    """Wrong for d = 1: query.squeeze() (meant for a (1, d) query) turns a (1,) query into a 0-d one, and
    keys (n, 1) @ a 0-d tensor raises. The text asks for any dimension d."""
    query = query.squeeze()
    return torch.softmax(keys @ query, dim=0) @ values


@bug("1.2", "softmax_dim")
def toy_softmax_over_the_size_one_axis(query, keys, values):
    """Wrong: the scores kept as a column (n, 1), the softmax taken over its size-one axis (every weight 1), then
    squeezed: the sum of the values."""
    scores = keys @ query[:, None]                  # (n, 1)
    weights = torch.softmax(scores, dim=1).squeeze(1)   # (n,) of ones
    return weights @ values


# ============================================================================ 2.2 MaskedAttention

class _Given02(nn.Module):
    def __init__(self, embed_dim, max_tokens, dropout_rate=0.0):
        super().__init__()
        self.embed_dim = embed_dim
        self.query = nn.Linear(embed_dim, embed_dim, bias=False)
        self.key = nn.Linear(embed_dim, embed_dim, bias=False)
        self.value = nn.Linear(embed_dim, embed_dim, bias=False)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.attn_dropout = nn.Dropout(dropout_rate)
        self.proj_dropout = nn.Dropout(dropout_rate)
        self.register_buffer("mask", causal_mask(max_tokens), persistent=False)


@correct("2.2")
class MaskedKeysMajorScores(_Given02):
    """Right: scores laid out keys-first, k @ q^T (N, Lk, Lq), the mask transposed to match, the softmax over the
    keys (now dim -2), the weights transposed back before the values."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores_t = k @ q.transpose(-2, -1) / self.embed_dim ** 0.5                # (N, Lk, Lq)
        scores_t = scores_t.masked_fill(~self.mask[:length, :length].T, float("-inf"))
        weights = torch.softmax(scores_t, dim=-2).transpose(-2, -1)               # (N, Lq, Lk)
        return self.proj_dropout(self.proj(self.attn_dropout(weights) @ v))


@correct("2.2")
class MaskedEinsumEllipsisFloat64Inside(_Given02):
    """Right: scores and softmax in float64 with einsum and an ellipsis, the weights cast back to x's dtype."""

    def forward(self, x):
        length = x.shape[-2]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = torch.einsum("...qe,...ke->...qk", q.double(), k.double()) * self.embed_dim ** -0.5
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        weights = self.attn_dropout(scores.softmax(-1).to(x.dtype))
        return self.proj_dropout(self.proj(torch.einsum("...qk,...ke->...qe", weights, v)))


@correct("2.2")
class MaskedBiasFilledInPlaceAndLogsumexp(_Given02):
    """Right: an additive bias made fresh (zeros like the scores) and filled in place, the softmax written as
    exp(s - logsumexp(s))."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = q @ k.mT / math.sqrt(self.embed_dim)
        bias = torch.zeros_like(scores)
        bias.masked_fill_(~self.mask[:length, :length], float("-inf"))
        scores = scores + bias
        weights = (scores - scores.logsumexp(-1, keepdim=True)).exp()
        return self.proj_dropout(self.proj(self.attn_dropout(weights) @ v))


@correct("2.2")
class MaskedBottomRightCornerOfTheBuffer(_Given02):
    """Right, if unusual: the bottom-right L x L corner of a lower-triangular buffer is lower-triangular too."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = q @ k.transpose(-2, -1) / self.embed_dim ** 0.5
        scores = scores.masked_fill(~self.mask[-length:, -length:], float("-inf"))
        return self.proj_dropout(self.proj(self.attn_dropout(scores.softmax(-1)) @ v))


@bug("2.2", "softmax_dim", "queries")
class MaskedTriuAndSoftmaxOverQueries(_Given02):
    """Wrong twice: the mask keeps the upper triangle (the future) and the softmax runs over the queries."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = q @ k.transpose(-2, -1) / self.embed_dim ** 0.5
        scores = scores.masked_fill(~self.mask[:length, :length].T, float("-inf"))
        return self.proj_dropout(self.proj(self.attn_dropout(scores.softmax(-2)) @ v))


@bug("2.2", "scale")
class MaskedUnscaledWithMinusTenThousand(_Given02):
    """Wrong twice, one harmless: no scaling, and -1e4 for the hidden scores (enough to hide them here)."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = self.query(x), self.key(x), self.value(x)
        scores = (q @ k.transpose(-2, -1)).masked_fill(~self.mask[:length, :length], -1e4)
        return self.proj_dropout(self.proj(self.attn_dropout(scores.softmax(-1)) @ v))


# ============================================================================ 3.3 MultiHeadMaskedAttention

class _Given03(nn.Module):
    def __init__(self, embed_dim, num_heads, max_tokens, dropout_rate=0.0):
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError("num_heads must divide embed_dim")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.query = nn.Linear(embed_dim, embed_dim, bias=False)
        self.key = nn.Linear(embed_dim, embed_dim, bias=False)
        self.value = nn.Linear(embed_dim, embed_dim, bias=False)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.attn_dropout = nn.Dropout(dropout_rate)
        self.proj_dropout = nn.Dropout(dropout_rate)
        self.register_buffer("mask", causal_mask(max_tokens), persistent=False)


@correct("3.3")
class MultiEinsumOnHeadShapedWeights(_Given03):
    """Right: each projection's weight viewed as (heads, head_dim, E) and applied per head by einsum; the output
    projection's weight viewed as (E, heads, head_dim) merges the heads and projects in one einsum."""

    def forward(self, x):
        h, d, length = self.num_heads, self.head_dim, x.shape[1]
        q = torch.einsum("nle,hde->nhld", x, self.query.weight.view(h, d, -1))
        k = torch.einsum("nle,hde->nhld", x, self.key.weight.view(h, d, -1))
        v = torch.einsum("nle,hde->nhld", x, self.value.weight.view(h, d, -1))
        scores = torch.einsum("...qd,...kd->...qk", q, k) / math.sqrt(d)
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        weights = self.attn_dropout(scores.softmax(-1))
        out = torch.einsum("nhqk,nhkd->nhqd", weights, v)
        return self.proj_dropout(torch.einsum("nhld,ehd->nle", out, self.proj.weight.view(-1, h, d)))


@correct("3.3")
class MultiFloat64InsideCastBack(_Given03):
    """Right: heads split with unflatten/movedim, the attention computed in float64, cast back before the merge."""

    def forward(self, x):
        length = x.shape[1]
        split = lambda t: t.unflatten(-1, (self.num_heads, self.head_dim)).movedim(-2, 1).double()
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = (q @ k.transpose(-1, -2)) * self.head_dim ** -0.5
        scores = torch.where(self.mask[:length, :length], scores, scores.new_tensor(float("-inf")))
        weights = self.attn_dropout(scores.softmax(-1))
        out = (weights @ v).to(x.dtype).movedim(1, -2).flatten(-2)
        return self.proj_dropout(self.proj(out))


@bug("3.3", "head_split", "heads are mixed")
class MultiViewNoTransposeAndScaleByEmbedDim(_Given03):
    """Wrong twice: the heads split by a bare view (N, heads, L, head_dim) and the scores scaled by sqrt(E)."""

    def forward(self, x):
        n, length, e = x.shape
        split = lambda t: t.reshape(n, self.num_heads, length, self.head_dim)
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = q @ k.transpose(-2, -1) / e ** 0.5
        scores = scores.masked_fill(~self.mask[:length, :length], float("-inf"))
        out = merge_heads(self.attn_dropout(scores.softmax(-1)) @ v)
        return self.proj_dropout(self.proj(out))


@bug("3.3", "causal_mask")
class MultiMaskShiftedAndProjDropoutFirst(_Given03):
    """Wrong twice: the causal mask hides the diagonal too (tril(-1), the first row then renormalised from NaN
    to zeros), and the output dropout sits before proj (harmless in eval mode)."""

    def forward(self, x):
        length = x.shape[1]
        q, k, v = (split_heads(f(x), self.num_heads) for f in (self.query, self.key, self.value))
        scores = q @ k.transpose(-2, -1) / self.head_dim ** 0.5
        hidden = ~self.mask[:length, :length].tril(-1)
        weights = torch.nan_to_num(scores.masked_fill(hidden, float("-inf")).softmax(-1))
        out = merge_heads(self.attn_dropout(weights) @ v)
        return self.proj(self.proj_dropout(out))


# ============================================================================ 4.2 (more)

@correct("4.2")
class BlockInPlaceResidualOnFreshOutputs(_Given04):
    """Right: each residual added in place to the sublayer's fresh output (h += x), never to x itself."""

    def forward(self, x):
        if self.norm_first:
            h = self.attn(self.ln1(x))
            h += x
            y = self.mlp(self.ln2(h))
            y += h
            return y
        s = self.attn(x)
        s += x
        h = self.ln1(s)
        t = self.mlp(h)
        t += h
        return self.ln2(t)


@bug("4.2", "norm_placement")
class BlockPlacementFromAForwardDefault(_Given04):
    """Wrong: the placement read from a keyword of forward (default pre-norm), not from self.norm_first, so a block
    built with norm_first=False still runs pre-norm."""

    def forward(self, x, norm_first=True):
        if norm_first:
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


BUGGY.append(Attempt("4.2", "BlockPlacementFromAForwardDefault_postnorm", BlockPlacementFromAForwardDefault,
                     "norm_placement", (), {"norm_first": False}))
BUGGY.remove(next(a for a in BUGGY if a.name == "BlockPlacementFromAForwardDefault"))


# ============================================================================ 4.3 (more)

@correct("4.3")
class GPTOneHotEmbeddingAndSequential(_GPT):
    """Right: the token embedding as one_hot(idx) @ weight in the weight's dtype, the blocks chained by an
    nn.Sequential made on the fly around the same block modules."""

    def forward(self, idx):
        length = idx.shape[1]
        if length > self.config.max_tokens:
            raise ValueError(f"idx has {length} tokens; this model takes at most max_tokens="
                             f"{self.config.max_tokens}: crop it to idx[:, -max_tokens:]")
        weight = self.token_embedding.weight
        tokens = F.one_hot(idx, self.config.vocab_size).to(weight.dtype) @ weight
        x = self.dropout(tokens + self.position_encoding(length))
        x = nn.Sequential(*self.blocks)(x)
        return F.linear(self.ln_f(x), self.head.weight)


@bug("4.3", "final_norm")
class GPTPositionsFromOneAndNoFinalNorm(_GPT):
    """Wrong twice: positions start at 1 (position_encoding(L, 1)) and the final LayerNorm is left out."""

    def forward(self, idx):
        length = idx.shape[1]
        if length > self.config.max_tokens:
            raise ValueError(f"idx has {length} tokens, more than max_tokens={self.config.max_tokens}: crop it")
        x = self.dropout(self.token_embedding(idx) + self.position_encoding(length, 1))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# ============================================================================ 7.1 split_c_attn

@correct("7.1")
def split_c_attn_transpose_then_reshape_r41(weight):
    """Right: weight.T (3E, E) holds the three transposed blocks one after another; reshape gives (3, E, E)."""
    e = weight.shape[0]
    return weight.T.reshape(3, e, e)


@correct("7.1")
def split_c_attn_unflatten_permute(weight):
    """Right: the columns unflattened as (3, E): weight[i, t, o]; permuted to [t, o, i], each block transposed."""
    return tuple(weight.unflatten(1, (3, weight.shape[0])).permute(1, 2, 0))


@correct("7.1")
def split_c_attn_copied_into_new_buffers(weight):
    """Right: three buffers made with weight.new_empty, each filled in place with its transposed block."""
    e = weight.shape[0]
    out = []
    for block in weight.split(e, dim=1):
        buffer = weight.new_empty(e, e)
        buffer.copy_(block.T)
        out.append(buffer)
    return out


@bug("7.1", "mismatch")
def split_c_attn_one_buffer_for_all_three(weight):
    """Wrong: one buffer made once and filled three times: the three results are the same tensor, the value's."""
    e = weight.shape[0]
    buffer = weight.new_empty(e, e)
    return tuple(buffer.copy_(block.T) for block in weight.split(e, dim=1))


@bug("7.1", "split_transpose")
def split_c_attn_einsum_that_keeps_the_layout(weight):
    """Wrong: an einsum that reads like a transpose but keeps Conv1D's (in, out) layout: 'itj->tij'."""
    e = weight.shape[0]
    return torch.einsum("itj->tij", weight.view(e, 3, e))


# ============================================================================ 7.2 attention_forward

def _causal72(q_len, k_len, device):
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=k_len - q_len)


@bug("7.2", "causal_mask")
def attention_forward_given_mask_anded_with_top_left_causal(module, query, key, value, attention_mask,
                                                            scaling=None, dropout=0.0, **kwargs):
    """Wrong with a cache and padding: 'to be safe' the given mask is ANDed with a causal mask aligned top-left
    (tril() of (Lq, Lk)). With as many queries as keys that changes nothing; with fewer (a KV cache, as in
    generation with padding) the last query sees only the first key."""
    q_len, k_len, d = query.shape[2], key.shape[2], query.shape[3]
    if attention_mask is None:
        mask = _causal72(q_len, k_len, query.device)
    else:
        mask = attention_mask & torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril()
    query = query * (scaling * d ** 0.5)
    return scaled_dot_product_attention(query, key, value, mask).transpose(1, 2), None


@bug("7.2", "causal_mask")
def attention_forward_mask_ignored_for_one_query(module, query, key, value, attention_mask, scaling=None,
                                                 dropout=0.0, **kwargs):
    """Wrong with a cache and padding: 'one new token needs no mask', so attention_mask is dropped when Lq == 1 and
    the padding keys get weight."""
    q_len, k_len, d = query.shape[2], key.shape[2], query.shape[3]
    if attention_mask is None or q_len == 1:
        mask = _causal72(q_len, k_len, query.device)
    else:
        mask = attention_mask
    query = query * (scaling * d ** 0.5)
    return scaled_dot_product_attention(query, key, value, mask).transpose(1, 2), None


@bug("7.2", "scale")
def attention_forward_query_times_scaling_and_top_left_mask(module, query, key, value, attention_mask,
                                                            scaling=None, dropout=0.0, **kwargs):
    """Wrong twice: the query multiplied by scaling alone (the course's function scales again), and the causal
    mask aligned top-left (wrong with a cache)."""
    q_len, k_len = query.shape[2], key.shape[2]
    mask = attention_mask if attention_mask is not None else \
        torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril()
    return scaled_dot_product_attention(query * scaling, key, value, mask).transpose(1, 2), None


@correct("7.2")
def attention_forward_einsum_ellipsis_float64(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                              **kwargs):
    """Right: written out with einsum and an ellipsis in float64, cast back; scaling=None falls back to d**-0.5."""
    q_len, k_len, d = query.shape[-2], key.shape[-2], query.shape[-1]
    scale = d ** -0.5 if scaling is None else scaling
    mask = _causal72(q_len, k_len, query.device) if attention_mask is None else attention_mask
    scores = torch.einsum("...qd,...kd->...qk", query.double(), key.double()) * scale
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    out = torch.einsum("...qk,...kd->...qd", weights, value.double()).to(query.dtype)
    return out.movedim(1, 2), None


@correct("7.2")
def attention_forward_torch_sdpa_with_scale(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                                            **kwargs):
    """Right: torch's fused function with its scale= argument; the causal case through a bottom-right mask built as
    the complement of a triu, on the query's device."""
    q_len, k_len = query.shape[-2], key.shape[-2]
    if attention_mask is None:
        mask = ~torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).triu(k_len - q_len + 1)
    else:
        mask = attention_mask
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.permute(0, 2, 1, 3).contiguous(), None


# ============================================================================ 9.3 RMSNorm

class _Given09Norm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))


@bug("9.3", "dtype", "float64")
class RMSNormVectorNormInFloat32(_Given09Norm):
    """Wrong for float64 input: vector_norm(x, dtype=torch.float32) refuses to narrow a float64 x (it raises);
    .float() would have cast it."""

    def forward(self, x):
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
        rms = (norm.square() / x.shape[-1] + self.eps).sqrt()
        return (x.float() / rms * self.weight.float()).to(x.dtype)


@correct("9.3")
class RMSNormEinsumEllipsis(_Given09Norm):
    """Right: the mean of squares by an einsum with an ellipsis, in float32, then rsqrt."""

    def forward(self, x):
        h = x.float()
        mean_square = torch.einsum("...d,...d->...", h, h).unsqueeze(-1) / h.shape[-1]
        return (h * torch.rsqrt(mean_square + self.eps) * self.weight.float()).to(x.dtype)


@correct("9.3")
class RMSNormVmapOverRows(_Given09Norm):
    """Right: one row's formula, vmapped over every row of x flattened to (rows, dim)."""

    def forward(self, x):
        def one(row):
            return row * torch.rsqrt(row.pow(2).mean() + self.eps)
        rows = x.float().reshape(-1, x.shape[-1])
        return (torch.func.vmap(one)(rows).reshape(x.shape) * self.weight.float()).to(x.dtype)


@correct("9.3")
class RMSNormInPlaceOnItsOwnCopy(_Given09Norm):
    """Right: the float32 copy made with copy=True, and the weight applied in place on the fresh product."""

    def forward(self, x):
        h = x.to(torch.float32, copy=True)
        out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out.mul_(self.weight.float())
        return out.to(x.dtype)


@bug("9.3", "mutation")
class RMSNormInPlaceOnWhatFloatReturns(_Given09Norm):
    """Wrong for float32 input: x.float() returns x itself when x is float32 already, so the in-place division and
    multiplication overwrite the caller's x (harmless only for float16/bfloat16 input, where .float() copies)."""

    def forward(self, x):
        h = x.float()
        with torch.no_grad():
            inv = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h.mul_(inv)
        return (h * self.weight.float()).to(x.dtype)


@bug("9.3", "norm_statistic", "absolute")
class RMSNormEpsOutsideAndMeanOfAbs(_Given09Norm):
    """Wrong twice: the mean of |x| squared instead of the mean of x squared, and eps added after the root."""

    def forward(self, x):
        h = x.float()
        rms = h.abs().mean(-1, keepdim=True) + self.eps
        return (h / rms * self.weight.float()).to(x.dtype)


# ============================================================================ 9.4 SwiGLU

class _Given09Glu(nn.Module):
    def __init__(self, embed_dim, hidden_dim):
        super().__init__()
        self.gate = nn.Linear(embed_dim, hidden_dim, bias=False)
        self.up = nn.Linear(embed_dim, hidden_dim, bias=False)
        self.down = nn.Linear(hidden_dim, embed_dim, bias=False)


@correct("9.4")
class SwiGLUSiluThenMulInPlace(_Given09Glu):
    """Right: the SiLU output (a fresh tensor) multiplied in place by the up branch."""

    def forward(self, x):
        h = F.silu(self.gate(x))
        h.mul_(self.up(x))
        return self.down(h)


@correct("9.4")
class SwiGLUThroughFGlu(_Given09Glu):
    """Right: silu(g) * u = (g * u) * sigmoid(g), which is F.glu of [g * u | g] along the last axis."""

    def forward(self, x):
        g, u = self.gate(x), self.up(x)
        return self.down(F.glu(torch.cat([g * u, g], dim=-1), dim=-1))


@correct("9.4")
class SwiGLUEinsumEllipsisFloat64(_Given09Glu):
    """Right: the three products as einsums with an ellipsis on the layers' weights, in float64, cast back."""

    def forward(self, x):
        h = x.double()
        g = torch.einsum("...e,he->...h", h, self.gate.weight.double())
        u = torch.einsum("...e,he->...h", h, self.up.weight.double())
        return torch.einsum("...h,eh->...e", F.silu(g) * u, self.down.weight.double()).to(x.dtype)


@bug("9.4", "gradient")
class SwiGLUSigmoidTimesInPlace(_Given09Glu):
    """Wrong for learning: silu written as sigmoid(g).mul_(g), in place on the sigmoid's output, which its
    backward needs: the forward is right, the backward raises."""

    def forward(self, x):
        g = self.gate(x)
        h = torch.sigmoid(g).mul_(g)
        return self.down(h * self.up(x))


@bug("9.4", "mismatch")
class SwiGLUSiluOnUpAndResidual(_Given09Glu):
    """Wrong twice: SiLU on the up branch instead of the gate, and x added to the output."""

    def forward(self, x):
        return x + self.down(self.gate(x) * F.silu(self.up(x)))


# ============================================================================ 10.3 FlashAttentionFunction

class _FlashGiven(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal=False, block_q=64, block_k=64):
        out, lse = flash.flash_attention(q, k, v, block_q=block_q, block_k=block_k, causal=causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.block_q, ctx.block_k = causal, block_q, block_k
        return out


def _future(qs, qe, ks, ke, device):
    return torch.arange(ks, ke, device=device)[None, :] > torch.arange(qs, qe, device=device)[:, None]


@correct("10.3")
class FlashBackwardKeysOuterLoop(_FlashGiven):
    """Right: FlashAttention-2's order, key blocks outside and query blocks inside (only those that may see the
    key block when causal), with einsums and an ellipsis."""

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        scale = q.shape[-1] ** -0.5
        lq, lk = q.shape[-2], k.shape[-2]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        delta = torch.einsum("...ld,...ld->...l", grad_out, out)
        for ks in range(0, lk, ctx.block_k):
            ke = min(ks + ctx.block_k, lk)
            k_blk, v_blk = k[..., ks:ke, :], v[..., ks:ke, :]
            first = (ks // ctx.block_q) * ctx.block_q if ctx.causal else 0
            for qs in range(first, lq, ctx.block_q):
                qe = min(qs + ctx.block_q, lq)
                q_blk, do_blk = q[..., qs:qe, :], grad_out[..., qs:qe, :]
                s = torch.einsum("...qd,...kd->...qk", q_blk, k_blk) * scale
                if ctx.causal and ke - 1 > qs:
                    s = s.masked_fill(_future(qs, qe, ks, ke, q.device), float("-inf"))
                p = torch.exp(s - lse[..., qs:qe, None])
                dv[..., ks:ke, :] += torch.einsum("...qk,...qd->...kd", p, do_blk)
                ds = p * (torch.einsum("...qd,...kd->...qk", do_blk, v_blk) - delta[..., qs:qe, None])
                dq[..., qs:qe, :] += torch.einsum("...qk,...kd->...qd", ds, k_blk) * scale
                dk[..., ks:ke, :] += torch.einsum("...qk,...qd->...kd", ds, q_blk) * scale
        return dq, dk, dv, None, None, None


@correct("10.3")
class FlashBackwardFloat64InsideCastBack(_FlashGiven):
    """Right: every block product and accumulator in float64, the gradients cast back to the inputs' dtype."""

    @staticmethod
    def backward(ctx, grad_out):
        q0, k0, v0, out0, lse0 = ctx.saved_tensors
        q, k, v, out, lse, do = (t.double() for t in (q0, k0, v0, out0, lse0, grad_out))
        scale = 1.0 / math.sqrt(q.shape[-1])
        lq, lk = q.shape[-2], k.shape[-2]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        delta = (do * out).sum(-1)
        for qs in range(0, lq, ctx.block_q):
            qe = min(qs + ctx.block_q, lq)
            for ks in range(0, min(lk, qe) if ctx.causal else lk, ctx.block_k):
                ke = min(ks + ctx.block_k, lk)
                s = q[..., qs:qe, :] @ k[..., ks:ke, :].transpose(-2, -1) * scale
                if ctx.causal and ke - 1 > qs:
                    s = s.masked_fill(_future(qs, qe, ks, ke, q.device), float("-inf"))
                p = torch.exp(s - lse[..., qs:qe, None])
                dv[..., ks:ke, :] += p.transpose(-2, -1) @ do[..., qs:qe, :]
                ds = p * (do[..., qs:qe, :] @ v[..., ks:ke, :].transpose(-2, -1) - delta[..., qs:qe, None])
                dq[..., qs:qe, :] += ds @ k[..., ks:ke, :] * scale
                dk[..., ks:ke, :] += ds.transpose(-2, -1) @ q[..., qs:qe, :] * scale
        return dq.to(q0.dtype), dk.to(k0.dtype), dv.to(v0.dtype), None, None, None


@correct("10.3")
class FlashBackwardDeltaFromAFirstPass(_FlashGiven):
    """Right, if slower: D_i = sum_j P_ij dP_ij summed in a first pass over the blocks (equal to rowsum(dO * O)),
    then the gradients in a second pass."""

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        scale = 1.0 / math.sqrt(q.shape[-1])
        lq, lk = q.shape[-2], k.shape[-2]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        delta = torch.zeros_like(lse)

        def blocks():
            for qs in range(0, lq, ctx.block_q):
                qe = min(qs + ctx.block_q, lq)
                for ks in range(0, min(lk, qe) if ctx.causal else lk, ctx.block_k):
                    ke = min(ks + ctx.block_k, lk)
                    s = q[..., qs:qe, :] @ k[..., ks:ke, :].transpose(-2, -1) * scale
                    if ctx.causal and ke - 1 > qs:
                        s = s.masked_fill(_future(qs, qe, ks, ke, q.device), float("-inf"))
                    p = torch.exp(s - lse[..., qs:qe, None])
                    dp = grad_out[..., qs:qe, :] @ v[..., ks:ke, :].transpose(-2, -1)
                    yield qs, qe, ks, ke, p, dp
        for qs, qe, _ks, _ke, p, dp in blocks():
            delta[..., qs:qe] += (p * dp).sum(-1)
        for qs, qe, ks, ke, p, dp in blocks():
            dv[..., ks:ke, :] += p.transpose(-2, -1) @ grad_out[..., qs:qe, :]
            ds = p * (dp - delta[..., qs:qe, None])
            dq[..., qs:qe, :] += ds @ k[..., ks:ke, :] * scale
            dk[..., ks:ke, :] += ds.transpose(-2, -1) @ q[..., qs:qe, :] * scale
        return dq, dk, dv, None, None, None


@bug("10.3", "mismatch", "dq, dk")
class FlashBackwardDeltaFromValuesAndUnscaledDk(_FlashGiven):
    """Wrong twice: D = rowsum(dO * V) (the values, not the output) and dK without its 1/sqrt(d)."""

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        scale = 1.0 / math.sqrt(q.shape[-1])
        lq, lk = q.shape[-2], k.shape[-2]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        delta = (grad_out * v).sum(-1)
        for qs in range(0, lq, ctx.block_q):
            qe = min(qs + ctx.block_q, lq)
            for ks in range(0, min(lk, qe) if ctx.causal else lk, ctx.block_k):
                ke = min(ks + ctx.block_k, lk)
                s = q[..., qs:qe, :] @ k[..., ks:ke, :].transpose(-2, -1) * scale
                if ctx.causal and ke - 1 > qs:
                    s = s.masked_fill(_future(qs, qe, ks, ke, q.device), float("-inf"))
                p = torch.exp(s - lse[..., qs:qe, None])
                dv[..., ks:ke, :] += p.transpose(-2, -1) @ grad_out[..., qs:qe, :]
                ds = p * (grad_out[..., qs:qe, :] @ v[..., ks:ke, :].transpose(-2, -1) - delta[..., qs:qe, None])
                dq[..., qs:qe, :] += ds @ k[..., ks:ke, :] * scale
                dk[..., ks:ke, :] += ds.transpose(-2, -1) @ q[..., qs:qe, :]
        return dq, dk, dv, None, None, None


# ============================================================================ 12.1 sliding_window_mask

@correct("12.1")
def sliding_window_band_of_tril_triu_and_sinks_filled_in_place(length, window, sinks=0):
    """Right: the band tril() & triu(-(window - 1)); the sinks as a fresh mask filled in place, ANDed with tril."""
    ones = torch.ones(length, length, dtype=torch.bool)
    band = ones.tril().triu(-(window - 1))
    sink = torch.zeros(length, length, dtype=torch.bool)
    sink[:, :sinks] = True
    sink &= ones.tril()
    return band | sink


@correct("12.1")
def sliding_window_short_circuit_when_the_window_covers_all(length, window, sinks=0):
    """Right: a window as long as the sequence is the causal mask, sinks or not (they lie inside it)."""
    if window >= length:
        return torch.ones(length, length, dtype=torch.bool).tril()
    d = torch.arange(length)[:, None] - torch.arange(length)
    return ((d >= 0) & (d < window)) | ((d >= 0) & (torch.arange(length) < sinks))


@bug("12.1", "causal_mask", "sinks")
def sliding_window_sinks_take_the_windows_budget(length, window, sinks=0):
    """Wrong: StreamingLLM's cache of `window` entries read as sinks + (window - sinks) recent keys: the sinks
    eat into the window."""
    recent = max(window - sinks, 1)
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    return ((i - j >= 0) & (i - j < recent)) | ((j < sinks) & (j <= i))


@bug("12.1", "causal_mask")
def sliding_window_one_too_wide_and_sinks_in_the_future(length, window, sinks=0):
    """Wrong twice: i - j <= window, and the sinks visible to every query, even before they come."""
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    return ((i - j >= 0) & (i - j <= window)) | (j < sinks)


# ============================================================================ 12.3 linear_attention_recurrent

def _phi(x):
    return F.elu(x) + 1


@bug("12.3", "shape")
def linear_read_squeezed_without_a_dim(q, k, v):
    """Wrong for d_v = 1: the read phi(q_i) S, (..., 1, d_v), squeezed with .squeeze() and no dim: with one value
    feature it drops that axis too (and any leading axis of 1), and the division by the (..., 1) normaliser
    then broadcasts into the wrong shape. Every case has d_v > 1, and the only leading 1 is on a single token."""
    fq, fk = _phi(q), _phi(k)
    s = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    z = q.new_zeros(*q.shape[:-2], q.shape[-1])
    outputs = []
    for i in range(q.shape[-2]):
        s = s + fk[..., i, :, None] * v[..., i, None, :]
        z = z + fk[..., i, :]
        numerator = (fq[..., i, None, :] @ s).squeeze()
        outputs.append(numerator / ((fq[..., i, :] * z).sum(-1, keepdim=True) + 1e-6))
    return torch.stack(outputs, dim=-2)


@correct("12.3")
def linear_addcmul_and_vecdot(q, k, v):
    """Right: S updated by torch.addcmul with the outer product as a broadcast, the read and the normaliser by
    torch.linalg.vecdot; phi = F.elu + 1."""
    fq, fk = _phi(q), _phi(k)
    s = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    z = q.new_zeros(*q.shape[:-2], q.shape[-1])
    outputs = []
    for i in range(q.shape[-2]):
        s = torch.addcmul(s, fk[..., i, :, None], v[..., i, None, :])
        z = torch.add(z, fk[..., i, :])
        numerator = torch.linalg.vecdot(fq[..., i, :, None], s, dim=-2)          # (..., d_v)
        denominator = torch.linalg.vecdot(fq[..., i, :], z).unsqueeze(-1) + 1e-6  # (..., 1)
        outputs.append(numerator / denominator)
    return torch.stack(outputs, dim=-2)


@bug("12.3", "mismatch", "two at once")
def linear_reads_first_and_normaliser_from_ones(q, k, v):
    """Wrong twice: the state read before token i is added, and z started at ones."""
    fq, fk = _phi(q), _phi(k)
    s = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    z = q.new_ones(*q.shape[:-2], q.shape[-1])
    outputs = []
    for i in range(q.shape[-2]):
        numerator = (fq[..., i, None, :] @ s).squeeze(-2)
        outputs.append(numerator / ((fq[..., i, :] * z).sum(-1, keepdim=True) + 1e-6))
        s = s + fk[..., i, :, None] * v[..., i, None, :]
        z = z + fk[..., i, :]
    return torch.stack(outputs, dim=-2)


# ============================================================================ more: size-1 axes

@bug("9.3", "norm_statistic", "1-D")
class RMSNormRowsByFlatten(_Given09Norm):
    """Wrong for a single vector x of shape (dim,), which the text's (..., dim) allows: x.flatten(0, -2) has no
    axis -2 to flatten to, and raises. Every case has at least two axes."""

    def forward(self, x):
        rows = x.float().flatten(0, -2)                                        # (rows, dim)
        rows = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + self.eps)
        return (rows.reshape(x.shape) * self.weight.float()).to(x.dtype)


@correct("9.3")
class RMSNormRowsByReshape(_Given09Norm):
    """Right, also for x of shape (dim,): reshape(-1, dim) and back."""

    def forward(self, x):
        rows = x.float().reshape(-1, x.shape[-1])
        rows = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + self.eps)
        return (rows.reshape(x.shape) * self.weight.float()).to(x.dtype)


@correct("7.2")
def attention_forward_zero_rows_for_left_padding(module, query, key, value, attention_mask, scaling=None,
                                                 dropout=0.0, **kwargs):
    """Right, and safe with left padding: a query that may see no key gets zero weights (as the course's
    course_attention_forward does) instead of 0/0 = NaN."""
    q_len, k_len, d = query.shape[2], key.shape[2], query.shape[3]
    mask = _causal72(q_len, k_len, query.device) if attention_mask is None else attention_mask
    sees = mask.any(-1, keepdim=True)
    out = scaled_dot_product_attention(query * (scaling * d ** 0.5), key, value, mask | ~sees) * sees
    return out.transpose(1, 2), None


@correct("12.3")
def linear_read_squeezed_at_its_axis(q, k, v):
    """Right, also for d_v = 1: the read squeezed at dim -2 only."""
    fq, fk = _phi(q), _phi(k)
    s = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1])
    z = q.new_zeros(*q.shape[:-2], q.shape[-1])
    outputs = []
    for i in range(q.shape[-2]):
        s = s + fk[..., i, :, None] * v[..., i, None, :]
        z = z + fk[..., i, :]
        outputs.append((fq[..., i, None, :] @ s).squeeze(-2) / ((fq[..., i, :] * z).sum(-1, keepdim=True) + 1e-6))
    return torch.stack(outputs, dim=-2)
