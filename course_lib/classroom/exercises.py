"""The one table of the course's exercises, read by everything around a student: the checks (``checks``),
hints and solutions, the grader's advice, the live room (``progress``), nbgrader metadata, collection
for notebook 08 and the learner copies.

An exercise is declared once, here, as data: its id ("2.2"), the name the student defines in the notebook
(``MaskedAttention``), a title, the checker that judges it (a name in ``checks``) and two or three hints.
How it is judged lives in ``checks/nbNN.py`` (see ``checks/DESIGN.md``); nothing registers itself on import.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Exercise", "Mistake", "EXERCISES", "BY_ID", "exercise", "exercise_order"]


@dataclass(frozen=True)
class Exercise:
    """One exercise: ``id`` "2.2", ``name`` what the student defines, ``title``, ``checker`` (its name in
    ``checks``), ``hints`` in order, ``has_solution`` (False where the notebook has no solution region:
    8.1 assembles the parts written before), and ``reference``: where the course's own version lives,
    ``"module.name"`` under ``course_lib`` (``"attention.toy_attention"``; 7.2's is ``"hf.course_attention_forward"``),
    or ``""`` where there is none (a prediction, a function of a layer). The reference guard imports exactly that
    module: a check of notebook 01 never loads transformers to find out that 1.1 has no course version.
    ``same_work``: other course functions, in the same form, that do the exercise's whole work under another
    name (1.3 is ``attention_weights(q, k, mask) @ v``): calling one is handing the work over too."""

    id: str
    name: str
    title: str
    checker: str
    has_solution: bool = True
    hints: tuple[str, ...] = ()
    reference: str = ""
    same_work: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not re.fullmatch(r"\d+\.\d+", self.id):
            raise ValueError(f"id: expected an exercise id such as '2.1', got {self.id!r}")
        if not 2 <= len(self.hints) <= 3:
            raise ValueError(f"exercise {self.id}: hints: expected two or three, got {len(self.hints)}")
        for field_name, where in (("reference", self.reference), *(("same_work", w) for w in self.same_work)):
            if where and not re.fullmatch(r"[a-z_]+(\.[a-z_]+)*\.[A-Za-z_]\w*", where):
                raise ValueError(f"exercise {self.id}: {field_name}: expected 'module.name' under course_lib, got "
                                 f"{where!r}")

    @property
    def notebook(self) -> str:
        """The notebook's number, "02": its solution region is read from ``02_*.ipynb``."""
        return f"{int(self.id.split('.')[0]):02d}"


@dataclass(frozen=True)
class Mistake:
    """One known mistake, the one form every checker uses: the diagnosis code (see ``verdict.DIAGNOSES``),
    what to tell the student, and how to reproduce it on a case's inputs: either ``output``, a function of
    the case's arguments giving the mistaken output (None where the mistake does not apply to that case),
    or ``spec``, the switches of the topic's variant function (the reference with the mistake switched on).
    A checker names the mistake when the student's output matches it, without reading any source."""

    code: str
    message: str
    spec: dict[str, Any] = field(default_factory=dict)
    output: Callable[..., Any] | None = None


EXERCISES: tuple[Exercise, ...] = (
    # notebook 01
    Exercise('1.1', 'my_prediction', 'predict toy attention by hand', 'check_toy_prediction', hints=(
        'Score each key by its dot product with the query [0, 1]: a key pointing the same way scores '
        'highest.',
        'A softmax turns the three scores into weights: exp(score) divided by the sum of the three exps.',
        'The result is the weighted average of TOY_VALUES: each value times its weight, added up. Notice '
        'that the first and third keys are mirror images.',
    )),
    Exercise('1.2', 'toy_attention', 'toy_attention', 'check_toy_attention',
             reference='attention.toy_attention', hints=(
        'Three steps: one score per key, a softmax over those scores, a weighted sum of the values.',
        'keys @ query gives all n scores at once; take the softmax along that single axis. No scaling '
        'here.',
        'weights @ values works for values of shape (n,) and (n, dv) alike.',
    )),
    Exercise('1.3', 'scaled_dot_product_attention', 'scaled_dot_product_attention',
             'check_scaled_dot_product_attention', reference='attention.scaled_dot_product_attention',
             same_work=('attention.attention_weights', 'flash.naive_attention'), hints=(
        'The same three steps as toy attention, for whole batches of queries: the scores have shape (..., '
        'Lq, Lk).',
        'Transpose only the last two axes of k, divide the scores by sqrt(d) with d = q.shape[-1], and '
        'take the softmax over the last axis (the keys).',
        'With a mask, give the scores of hidden keys (mask False) the value -inf before the softmax; '
        'leave the scores alone when mask is None.',
    )),
    # notebook 02
    Exercise('2.1', 'causal_mask', 'causal_mask', 'check_causal_mask', reference='attention.causal_mask',
             same_work=('modern.sliding_window_mask', 'variants.sliding_window_mask',   # window = n
                        'variants.sliding.window_mask_at'), hints=(
        'Row i of the mask says which positions token i may look at: itself and everything before it.',
        'That is a lower-triangular pattern, True on and below the diagonal; torch.tril keeps exactly '
        'that part.',
        'Start from an (n, n) tensor of ones with dtype=torch.bool.',
    )),
    Exercise('2.2', 'MaskedAttention', 'MaskedAttention.forward', 'check_masked_attention',
             reference='attention.MaskedAttention', hints=(
        'Project x into q, k and v with self.query, self.key and self.value, then attend as in exercise '
        '1.3 with the causal mask.',
        'The mask buffer is max_tokens x max_tokens: use only its first L rows and columns for a sequence '
        'of L tokens, and hide the future with -inf before the softmax. One head uses all the features, '
        'so scale by 1/sqrt(embed_dim).',
        'After the softmax: self.attn_dropout on the weights, weights times v, then self.proj and '
        'self.proj_dropout. Dropout layers follow model.train() / model.eval() by themselves.',
    )),
    # notebook 03
    Exercise('3.1', 'split_heads', 'split_heads', 'check_split_heads', reference='attention.split_heads', hints=(
        'Each head gets its own contiguous block of head_dim = E // num_heads features, at every '
        'position.',
        'First give the last axis the shape (num_heads, head_dim): (N, L, E) -> (N, L, heads, head_dim).',
        'Then swap the sequence and head axes to get (N, heads, L, head_dim).',
    )),
    Exercise('3.2', 'merge_heads', 'merge_heads', 'check_merge_heads', reference='attention.merge_heads', hints=(
        "merge_heads undoes split_heads: the heads' outputs end up side by side along the features.",
        'Swap the head and sequence axes back first: (N, heads, L, head_dim) -> (N, L, heads, head_dim).',
        'Then flatten the last two axes; after a transpose use .reshape (or .contiguous() before .view).',
    )),
    Exercise('3.3', 'MultiHeadMaskedAttention', 'MultiHeadMaskedAttention.forward', 'check_multi_head_attention',
             reference='attention.MultiHeadMaskedAttention', hints=(
        'The same steps as MaskedAttention, but q, k and v are split into heads before the scores and the '
        'heads are merged again before the output projection.',
        'The scores are now (N, heads, L, L): the (L, L) causal mask broadcasts over batch and heads. '
        'Scale by 1/sqrt(head_dim), not 1/sqrt(embed_dim).',
        'Softmax over the last axis, self.attn_dropout, weights times v, merge_heads, then self.proj and '
        'self.proj_dropout.',
    )),
    # notebook 04
    Exercise('4.1', 'sinusoidal_table', 'sinusoidal_table', 'check_sinusoidal_table',
             reference='model.sinusoidal_table', hints=(
        'Build a column of positions (max_tokens, 1) and a row of frequencies (1, embed_dim // 2); their '
        'product is every angle at once, by broadcasting.',
        'Frequency of pair i: 1 / 10000^(2i / embed_dim). Computing it as exp(2i * -log(10000) / '
        'embed_dim) is the same number and numerically kinder.',
        'Start from torch.zeros(max_tokens, embed_dim) and fill the even columns (0::2) with the sines '
        'and the odd columns (1::2) with the cosines of the same angles.',
    )),
    Exercise('4.2', 'TransformerBlock', 'TransformerBlock.forward', 'check_transformer_block',
             reference='model.TransformerBlock', hints=(
        'Two sublayers, each wrapped the same way: attention first, then the feed-forward network.',
        "Residual: each sublayer's output is added to the x it read, x + sublayer(...). Pre-norm keeps that sum "
        'as the new x; post-norm replaces x by the sum normalised, ln(x + sublayer(x)).',
        'Pre-norm (norm_first=True, GPT-2) normalises what goes INTO each sublayer (ln1 before attn, ln2 '
        'before mlp); post-norm normalises the sum AFTER each residual addition.',
    )),
    Exercise('4.3', 'GPT', 'GPT.forward', 'check_gpt', reference='model.GPT', hints=(
        'Token embeddings (N, L, E) plus position encodings (L, E) broadcast over the batch; then '
        'dropout.',
        'Run x through every block in self.blocks, in order, then the final LayerNorm self.ln_f and the '
        'head.',
        'Return the raw logits (N, L, vocab_size): no softmax. Too long an idx must end in a ValueError that '
        'says to crop: self.position_encoding raises one already; checking idx.shape[1] against '
        'self.config.max_tokens first lets yours name idx.',
    )),
    # notebook 05
    Exercise('5.1', 'lm_windows', 'lm_windows', 'check_lm_windows', reference='data.lm_windows', hints=(
        'A window needs max_tokens + 1 consecutive tokens: the inputs are the first max_tokens, the '
        'targets the last max_tokens (the same tokens shifted by one).',
        'Windows start every max_tokens tokens: 0, max_tokens, 2 * max_tokens, ... A start s fits when s '
        '+ max_tokens + 1 <= len(ids).',
        'Tensor.unfold(0, size, step) cuts all windows at once; a list of slices stacked with torch.stack '
        'works too.',
    )),
    Exercise('5.2', 'lm_loss', 'lm_loss', 'check_lm_loss', reference='train.lm_loss',
             same_work=('train._cross_entropy',), hints=(
        'F.cross_entropy takes raw logits (it applies log_softmax itself) and averages over the targets.',
        'It wants the classes in dimension 1: flatten logits (N, L, V) to (N*L, V) and targets (N, L) to '
        '(N*L,).',
        'Targets of -100 are padding; F.cross_entropy skips them by default (ignore_index=-100), and the '
        'mean runs over the remaining targets only.',
    )),
    Exercise('5.3', 'train_step', 'train_step', 'check_train_step', reference='train.train_step',
             same_work=('train.update',), hints=(
        'Five lines: forget the old gradients, compute the logits, the loss, the gradients, then update.',
        'The optimizer clears the gradients and applies the update; the loss tensor computes the '
        'gradients. Old gradients must be gone before backward, and the update needs the new ones.',
        'Call model.train() first (evaluation switches dropout off), clip between backward and step '
        'unless max_grad_norm is None, and return loss.item(), a plain float.',
    )),
    Exercise('5.4', 'sample_next_token', 'sample_next_token', 'check_sampling',
             reference='generate.sample_next_token', hints=(
        'Temperature 0 is the greedy special case: handle it first, with argmax over the vocabulary.',
        'Otherwise divide the logits by the temperature, softmax over the last dimension, then draw one '
        'token per row with torch.multinomial (pass the generator).',
        'top_k: find the k-th largest logit of each row (torch.topk) and set every logit below it to -inf '
        'before the softmax.',
    )),
    # notebook 06
    Exercise('6.1', 'flops_per_token', 'flops_per_token', 'check_flops_per_token',
             reference='train.flops_per_token', hints=(
        'Two terms: the weights (6 FLOPs per weight per token) and attention (12·n·H·Q·T per token).',
        'Read the sizes from config: n = config.num_layers, H = config.num_heads, Q = config.head_dim, T '
        '= config.max_tokens. N is the num_weights argument.',
        'return 6 * num_weights + 12 * n * H * Q * T, with each letter taken from config.',
    )),
    Exercise('6.2', 'generate_with_cache', 'generate_with_cache', 'check_kv_cache',
             reference='generate.generate_with_cache', same_work=('generate.generate',), hints=(
        'One cache for the whole generation: cache = model.new_cache(), before the loop.',
        'Feed the prompt once with the cache; afterwards feed ONLY the newest token (shape (N, 1)) with '
        'the same cache: the model continues its positions after the cached ones.',
        "Each step: take the argmax of the last position's logits (keepdim), append it to idx, and feed "
        'it back.',
    )),
    # notebook 07
    Exercise('7.1', 'split_c_attn', 'split_c_attn', 'check_split_c_attn', reference='hf.split_c_attn', hints=(
        'c_attn is one Conv1D whose 3E outputs are the query, key and value side by side: split the last '
        'dimension.',
        'Conv1D computes x @ W with W of shape (in, out); nn.Linear computes x @ W.T with W of shape '
        '(out, in).',
        'weight.split(embed_dim, dim=1) (or chunk(3, dim=-1)) gives three (E, E) blocks; each needs a '
        'transpose.',
    )),
    Exercise('7.2', 'attention_forward', 'attention function for transformers', 'check_hf_attention',
             reference='hf.course_attention_forward', hints=(
        'The function gets query, key, value as (N, heads, L, head_dim) and returns (attn_output, None), '
        'with attn_output as (N, L, heads, head_dim): the model merges the heads itself.',
        'Use the `scaling` argument for the scores. attention_mask is bool (True = may attend) or None; '
        'None means a plain causal mask, which you then apply yourself.',
        "The course's scaled_dot_product_attention scales by head_dim ** -0.5 itself: multiply the query by "
        'scaling * head_dim ** 0.5 first. Ignore dropout (the models run in eval mode here).',
    )),
    # notebook 08
    Exercise('8.1', 'GPT', 'train your GPT like the reference', 'check_trains_like_reference',
             has_solution=False, hints=(
        '8.1 compares two TrainingRuns from capstone.train_parts: same start, same batches, so a correct '
        "set of parts ends within the tolerance of the reference's validation loss.",
        'A NaN means a part misbehaves in training mode (dropout, masking with -inf): run '
        'capstone.find_blame to swap your parts in one at a time and see which one moves the loss.',
    )),
    # notebook 09
    Exercise('9.1', 'rope_tables', 'rope_tables', 'check_rope_tables', reference='modern.rope_tables',
             same_work=('variants.sliding.rope_rows',), hints=(
        'Pair i (dimensions i and i + head_dim/2) turns by the angle m * w_i at position m, with w_i = '
        'theta^(-2i/head_dim): the first pair turns fastest, the last slowest.',
        'Build the head_dim/2 frequencies from torch.arange(0, head_dim, 2) / head_dim, and the angles as '
        'the outer product of the positions 0 .. max_tokens-1 with them: shape (max_tokens, head_dim/2).',
        'Each row needs the angles for both halves of the head: concatenate the angles with themselves '
        '(not repeat_interleave), then take .cos() and .sin(); return float32 tables.',
    )),
    Exercise('9.2', 'apply_rotary', 'apply_rotary', 'check_apply_rotary', reference='modern.apply_rotary', hints=(
        'x is (N, heads, L, head_dim): the tokens run along the second-to-last axis, so L = x.shape[-2], '
        'and their positions are offset, offset+1, ..., offset+L-1.',
        'Cut the rows of those positions out of cos and sin: (L, head_dim) broadcasts over N and heads by '
        'itself. rotate_half(x) splits the last axis into two halves x1, x2 and returns cat(-x2, x1).',
        "The turn is x * cos + rotate_half(x) * sin: write it as a new tensor (never in place), in x's "
        'dtype.',
    )),
    Exercise('9.3', 'RMSNorm', 'RMSNorm.forward', 'check_rms_norm', reference='modern.RMSNorm', hints=(
        'RMSNorm is LayerNorm without the mean and the bias: divide each vector (the last axis) by its '
        'root mean square, then multiply by the learned self.weight.',
        'The root mean square is sqrt(mean(x^2) + eps) with the mean over dim=-1, keepdim=True; eps '
        '(self.eps) goes inside the square root. torch.rsqrt(...) multiplies by 1/sqrt in one step.',
        'float16 squares overflow above 65504: compute in float32 (x.float()) and cast the result back to '
        "x's dtype.",
    )),
    Exercise('9.4', 'SwiGLU', 'SwiGLU.forward', 'check_swiglu', reference='modern.SwiGLU', hints=(
        'Two projections of x to hidden_dim: self.gate(x) goes through SiLU, self.up(x) stays linear.',
        'Multiply the two element by element (the gate scales each hidden feature), then project back '
        'with self.down.',
        'SiLU(z) = z * sigmoid(z) is F.silu; no residual here, the block adds it.',
    )),
    Exercise('9.5', 'repeat_kv', 'repeat_kv', 'check_repeat_kv', reference='modern.repeat_kv', hints=(
        'Query head h shares key/value head h // groups: heads 0 .. groups-1 read kv head 0, the next '
        'group kv head 1.',
        'So each kv head appears `groups` times in a row: [0, 0, 1, 1], not [0, 1, 0, 1] (which is what '
        'x.repeat gives).',
        'torch.repeat_interleave(x, groups, dim=1) does it; so does expanding a new axis right after the '
        'heads, then reshaping to (N, kv_heads * groups, L, head_dim).',
    )),
    Exercise('9.6', 'GroupedQueryAttention', 'GroupedQueryAttention.forward', 'check_grouped_query_attention',
             reference='modern.GroupedQueryAttention', hints=(
        'Project x to q (num_heads heads) and to k, v (num_kv_heads heads each); split them into (N, '
        'heads, L, head_dim); rotate q and k (never v) with apply_rotary, offset = the number of tokens '
        'already cached.',
        'With a cache, append the ROTATED new keys and the values (num_kv_heads heads) and use everything '
        'it returns; only then repeat_kv each to num_heads heads for the scores.',
        'Causal attention scaled by 1/sqrt(head_dim): with a cache the new queries sit at positions start '
        '.. total-1, so their mask rows are those of a (total, total) causal mask. Merge the heads, then '
        'self.proj.',
    )),
    # notebook 10
    Exercise('10.1', 'online_softmax', 'online_softmax', 'check_online_softmax',
             reference='flash.online_softmax', hints=(
        'Keep two numbers per row while reading the blocks: the largest score so far, m, and the sum so '
        'far, l = sum of exp(x_j - m) over the entries read.',
        'For a new block: m_new = torch.maximum(m, block.amax(dim=-1)). The old sum was measured against '
        'm, so it becomes l * exp(m - m_new) + exp(block - m_new[..., None]).sum(-1). Start with m = -inf '
        'and l = 0 (exp(-inf) is 0). A row whose first block is all -inf still has m_new = -inf, and '
        'exp(-inf - (-inf)) is NaN: there, measure against 0 (torch.where(m_new == float("-inf"), 0, m_new)) in '
        'both exps.',
        'After the last block every statistic is final: return torch.exp(x - m[..., None]) / l[..., '
        'None].',
    )),
    Exercise('10.2', 'flash_attention', 'flash_attention', 'check_flash_attention',
             reference='flash.flash_attention', hints=(
        'Two loops: over query blocks q[..., qs:qe, :] (qe = min(qs + block_q, Lq)), and inside over key '
        'blocks. Per query block keep m (-inf), l (0) and acc (zeros, (..., Bq, dv)); scale q once by '
        '1/sqrt(d).',
        'Per key block: s = q_blk @ k_blk^T; m_new = torch.maximum(m, s.amax(-1)); p = exp(s - m_new[..., '
        'None]); c = exp(m - m_new); l = l * c + p.sum(-1); acc = acc * c[..., None] + p @ v_blk; m = m_new. '
        'At the end out = acc / l[..., None], lse = m + log(l).',
        'Causal: query block [qs, qe) needs the key blocks starting before qe only (stop the key loop '
        "there), and in a block crossing the diagonal, s = -inf where the key's position k_start + col is "
        "after the query's q_start + row.",
    )),
    Exercise('10.3', 'FlashAttentionFunction', 'FlashAttentionFunction', 'check_flash_backward',
             reference='flash.FlashAttentionFunction', hints=(
        'The forward saved q, k, v, out and lse. First D = (dO * out).sum(-1), one number per query; then '
        'loop over query blocks and, inside, key blocks (skip the future ones when causal), as in the '
        'forward.',
        'Per block: s = q_blk @ k_blk^T * scale (masked when causal), p = exp(s - lse_blk[..., None]): '
        'the weights, exactly, without any running maximum. dv_blk += p^T @ do_blk; dp = do_blk @ '
        'v_blk^T.',
        'ds = p * (dp - D_blk[..., None]); dq_blk += ds @ k_blk * scale; dk_blk += ds^T @ q_blk * scale. '
        'Return dq, dk, dv, None, None, None: one gradient per forward argument.',
    )),
    # notebook 11
    Exercise('11.1', 'previous_token_score', 'previous_token_score', 'check_previous_token_score',
             reference='heads.previous_token_score', hints=(
        'Entry [n, h, i, j] is how much query i of sequence n attends to key j in head h. The previous '
        'token of query i is key i - 1: the entries (1, 0), (2, 1), ..., (L-1, L-2), just below the main '
        'diagonal.',
        'weights.diagonal(offset=-1, dim1=-2, dim2=-1) gathers them: shape (N, heads, L-1). Position 0 '
        'has no previous token and is not among them.',
        'Average over the batch (axis 0) and over the L-1 positions (the last axis): .mean(dim=(0, 2)) '
        'gives (heads,).',
    )),
    Exercise('11.2', 'induction_score', 'induction_score', 'check_induction_score',
             reference='heads.induction_score', hints=(
        'Query i of the second half (i >= half) holds the same token as position i - half. An induction '
        'head attends to the token that FOLLOWED that copy: key i - half + 1.',
        'The entries (i, i - half + 1) lie on the diagonal at offset -(half - 1). That diagonal starts at '
        'query half - 1, which is still in the first half: keep only queries half .. L-1 (drop its first '
        'entry).',
        'weights.diagonal(offset=-(half - 1), dim1=-2, dim2=-1)[..., 1:] has shape (N, heads, half) for L '
        '= 2*half; average over the batch and the last axis: .mean(dim=(0, 2)).',
    )),
    Exercise('11.3', 'ablate_head', 'ablate_head', 'check_ablate_head', reference='heads.ablate_head', hints=(
        "Each block's attention computes the heads' outputs, merges them into (N, L, heads * head_dim) "
        'and passes that to its output projection `proj`. Head h owns the columns h * head_dim .. (h+1) * '
        'head_dim - 1 of it.',
        "A forward pre-hook on model.blocks[layer].attn.proj sees proj's input before proj runs and may "
        "return a replacement: a copy of the input with the head's columns set to 0 "
        '(register_forward_pre_hook returns a handle whose .remove() takes the hook off).',
        'With @contextlib.contextmanager: register the hook, then `try: yield model` and `finally: '
        'handle.remove()`, so the hook is removed even when the code inside the `with` raises.',
    )),
    # notebook 12
    Exercise('12.1', 'sliding_window_mask', 'the sliding-window mask with sinks', 'check_sliding_window_mask',
             reference='variants.sliding_window_mask', hints=(
        'Build the query index i as a column (length, 1) and the key index j as a row (1, length): i - j is then '
        'a (length, length) grid of distances.',
        'A key is in the window when 0 <= i - j < window: itself and the window - 1 keys before it, never the '
        'future.',
        'Sinks: OR the window with (j < sinks) & (j <= i), so the first sinks keys stay visible, but only once '
        'the query has reached them. Return dtype torch.bool.',
    )),
    Exercise('12.2', 'latent_attention', 'multi-head latent attention with its latent cache', 'check_latent_attention',
             hints=(
        'Queries: split each head into its part without position (qk_nope_head_dim) and its rotary part '
        '(qk_rope_head_dim); only the rotary part is turned, to positions start = cache.length (0 without a '
        'cache), read before appending.',
        'kv_a_proj_with_mqa(x) gives the latent (kv_lora_rank numbers, then kv_a_layernorm) and one rotary key '
        'shared by every head (rotate it now). These two are what cache.append takes: never the up-projected '
        'keys.',
        'kv_b_proj on everything the cache returns gives, per head, k_nope then v; the key is k_nope beside the '
        'shared k_rope. Scores times layer.softmax_scale, the causal mask rows start .. start + L - 1 of the '
        'T x T lower triangle, softmax, values, merge heads, o_proj.',
    )),
    Exercise('12.3', 'linear_attention_recurrent', 'linear attention as a recurrence', 'check_linear_attention_recurrent',
             reference='variants.linear_attention_recurrent', same_work=('variants.linear_attention',), hints=(
        'phi(x) = elu(x) + 1 (variants.elu_feature_map) on q and k first. The state is S, zeros (..., d, d_v), '
        'and the normaliser z, zeros (..., d).',
        'For each token i: add the outer product phi(k_i) v_i^T to S and phi(k_i) to z FIRST (query i sees its '
        'own key), then read: phi(q_i) S divided by phi(q_i) . z + 1e-6.',
        'Index the token axis with [..., i, :] so any leading batch and head axes ride along; torch.stack the '
        'outputs along dim=-2.',
    )),

)

BY_ID: dict[str, Exercise] = {entry.id: entry for entry in EXERCISES}   # "2.2" -> its exercise


def exercise_order(exercise_id: str) -> tuple[int, ...]:
    """Sort key of an id: "10.1" after "9.6"."""
    return tuple(int(part) for part in exercise_id.split("."))


def exercise(exercise_id: Any) -> Exercise:
    """The exercise with this id ("2.2"); a ValueError that lists the ids otherwise."""
    key = str(exercise_id)
    if key not in BY_ID:
        raise ValueError(f"exercise_id: expected one of {sorted(BY_ID, key=exercise_order)}, got {exercise_id!r}")
    return BY_ID[key]
