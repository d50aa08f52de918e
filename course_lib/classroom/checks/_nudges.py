"""The first hint after a failed check: a nudge written for the mistake its diagnosis names.

A nudge asks the question that leads to the fix, without the fix (the check's message already
says what is wrong; the spec's hints say how to write it).
"""
from __future__ import annotations

NUDGES: dict[str | tuple[str, str], str] = {
    "shape": "Write the shape of every tensor next to the line that makes it, (N, L, E) and so on, and find the "
             "first line whose shape is not what the text says.",
    "dtype": "Which line creates a tensor of another dtype than the input's? A new tensor, a .float(), a table "
             "of float32 multiplied with float16, or a Python list.",
    "device": "Which tensors does your code create itself (torch.ones, torch.arange, torch.zeros)? Each one "
              "must be made on the input's device, or registered as a buffer.",
    "nan": "Where can a row be all -inf before a softmax, or a division by zero happen?",
    "precision": "Which step is computed in a low precision (float16, bfloat16) or rounded on the way?",
    "softmax_dim": "After the softmax, which numbers should add up to one: one query's weights over all keys, "
                   "or one key's weights over all queries? Which axis holds the keys?",
    "scale": "What would the scores' spread be if each of the d dimensions added a term of size one? That is "
             "the factor the scores are divided by.",
    "normalization": "Do your weights add up to one along the keys? Print weights.sum(-1).",
    "causal_mask": "For query i, which keys j may it see? Draw the L x L grid and shade the allowed cells.",
    "head_split": "Take one token's features and follow them: which head and which position does each end up "
                  "in after your reshape and transpose?",
    "values": "Which projection should the weights mix, and which one does your code use?",
    "batch_mixing": "Does any reshape put two sequences of the batch (or two positions) into the same row?",
    "dropout": "Where does dropout act in the reference, and is it off in eval mode?",
    "residual": "Follow x through your block: is each sublayer's output added back to the x that went into it, "
                "once, around attention and around the MLP (with the LayerNorm before the sublayer or after the "
                "sum, as the placement says)?",
    "norm_placement": "Where does the normalisation sit: on the input of the sublayer, or on its output?",
    "rope_layout": "Which two dimensions form a pair that turns together: (i, i + d/2), or (2i, 2i + 1)?",
    "rope_rotation": "Turn the 2-D vector (1, 0) by 90 degrees by hand: what do cos and sin multiply, and where "
                     "does the minus sign go?",
    "rope_frequencies": "Write the angle of pair i at position m as a formula and compute it by hand for i = 0 "
                        "and i = 1: does your code give the same?",
    "rope_positions": "Which positions do the rows of x sit at, counting the tokens already cached?",
    "rope_axes": "On which axis are the positions when you rotate? Print the shape you pass to apply_rotary.",
    "rope_missing": "Which tensors must be turned so that a score depends on the distance between two tokens?",
    "rotated_values": "Which tensors meet in a dot product? Only those need turning.",
    "epsilon": "Where does eps go, and which eps does the module hold?",
    "norm_weight": "After normalising, what does self.weight do to each feature?",
    "norm_statistic": "Which single number per vector does RMSNorm divide by? Compute it by hand for (3, 4).",
    "gating": "Write the formula with three projections: which one goes through SiLU, which ones multiply?",
    "kv_grouping": "Query head h should read which key/value head? Write the list for 4 query heads and 2 "
                   "key/value heads.",
    "kv_cache": "What does the cache hold after each call, and which positions do the new tokens have?",
    "gradient": "The numbers are right but the gradient is not: which line runs under torch.no_grad(), calls "
                ".detach(), .item() or .data, or rebuilds a tensor from Python numbers?",
    "mutation": "Which line changes one of the inputs in place (+=, *=, a method ending in _, t[...] = )?",
    "generator": "Which random call does not use the generator you were given?",
    "clipping": "When is the gradient norm clipped: after backward, before the optimizer step?",
    "exception": "Read the last line of the error in the check's message: which line of yours raised it, and "
                 "what did it receive? Call your code on the smallest input the exercise describes and print "
                 "each intermediate.",
    "timeout": "Which loop could run forever, or far longer than the input's size asks for? Count its "
               "iterations for a small input.",
    "zero_grad": "When are the gradients of the previous step cleared: before backward, or not at all? Where "
                 "would clearing them wipe the gradients you just computed?",
    "flops_factor": "A training step runs the forward pass and the backward pass: how many FLOPs per parameter "
                    "and token does each cost?",
    "split_transpose": "After the reshape to (N, L, heads, head_dim), which axis must come before the positions "
                       "so that each head attends over its own sequence?",
    "final_norm": "Follow x from the last block to the language-model head: what does the reference do to it "
                  "in between?",
    "no_kv_cache": "At each new token, which cache does your loop pass to the model, and is it the one the "
                   "previous step filled?",
    "overlapping_windows": "Write the start of the first three windows for a small text: how far apart are "
                           "they, and how far apart should they be?",
    "online_rescale": "When a later block holds a larger score, the running maximum grows: what must happen "
                      "to the sum (and the output) you accumulated with the old maximum?",
    "running_max": "Which maximum do you subtract: the largest score seen so far, or only the current block's?",
    "overflow": "What is exp(100) in float32? Which number do you subtract from the scores before exp?",
    "magnitude": "If every score in a row were below -1000, what would exp give for each, and what is their sum? "
                 "Which maximum (that row's own, from -inf) makes the largest term exp(0) = 1?",
    "early_normalization": "How many times should the output be divided by the sum of weights: once per block, "
                           "or once, after the last block?",
    "block_bounds": "Write the first and last index of every block for a length that is not a multiple of the "
                    "block size: is every position in exactly one block?",
    "block_skip": "For a causal mask, which key blocks can a query block see? Draw the grid of blocks and "
                  "shade the ones that hold any allowed cell.",
    "full_scores": "Which line builds a tensor as large as L x L? Every score tensor should be one block by "
                   "one block.",
    "not_tiled": "Does any line reduce or multiply over a whole row of keys at once, or call a fused "
                 "attention? Each step should touch one block of keys.",
    "logsumexp": "The log of the softmax's denominator: write it with the running maximum m and the running "
                 "sum l, and check it on one row by hand.",
    "backward_delta": "D is one number per query row: which two tensors of the forward pass and the incoming "
                      "gradient does it multiply?",
    "transposed": "Write the shape of each factor of dV, dK and dQ: which matrix must be transposed for the "
                  "shapes to fit?",
    "score_offset": "For a previous-token head, which key should query i look at? For an induction head, after "
                    "the repeat, which key follows the earlier copy of the current token?",
    "score_positions": "Which query positions have a token to look at? Average over those only.",
    "score_axes": "Print the shape of the weights you receive: which axes are batch, heads, queries and keys, "
                  "and which of them does the score keep?",
    "ablation_method": "Switching a head off removes what it adds to the output: which tensor carries that, and "
                       "does your code zero it?",
    "ablation_slice": "In the merged output of shape (N, L, heads * head_dim), which columns belong to head h?",
    "not_restored": "After the with-block ends (or raises), is the model exactly as before? Which hook or "
                    "weight did you change, and where is it undone?",
    "global_setting": "Which line sets something for the whole process (torch.set_default_dtype, "
                      "torch.set_grad_enabled) without putting it back before your code returns?",
    "kept_state": "Call your code twice with different inputs (or after changing a weight): does the second "
                  "answer change? What does your code store on self, or in a global, that a later call reads?",
    "missing": "Is the exercise's cell in your notebook, under its own name?",
    "calls_reference": "Which steps does the course's version do that your code should do itself?",
    "patched": "Which line of your notebook assigns to something inside torch (torch.x = ..., setattr(torch, ...))? "
               "Without it, and after a kernel restart, what does your function return?",
    "crashed": "Which line could end the process: a huge allocation, os._exit, a signal?",
    "mismatch": "Compare your output with the reference's on the smallest input where they differ: which "
                "entries are wrong, and by how much?",
}

# The same question where no counter-example can be shown (no searcher for the exercise, or none found): it
# never promises an input it does not show; the student makes one, small enough to follow by hand.
_MISMATCH_WITHOUT_EXAMPLE = (
    "Make a small input of your own (a length of 3 to 5, a width of 2; blocks of 2 where there are blocks), run "
    "your code and the reference from course_lib on it, print both outputs, and find the first entry that "
    "differs: which part of your code computes it?")


def nudge(diagnosis: str, example: bool = True, exercise: str = "") -> str:
    """The nudge for a diagnosis (the exercise's own where it has one); ``example`` says whether a counter-example
    will be shown after it."""
    if (exercise, diagnosis) in NUDGES:
        return NUDGES[exercise, diagnosis]
    if diagnosis not in NUDGES or diagnosis == "mismatch":
        return NUDGES["mismatch"] if example else _MISMATCH_WITHOUT_EXAMPLE
    return NUDGES[diagnosis]


# Notebook 12's diagnoses (appended: this file is shared by every notebook's checks).
NUDGES.update({
    "state_order": "For token i, write the two steps in order: does query i's read already include token i's "
                   "key and value?",
    "feature_map": "Which function turns q and k into the features whose dot product is the weight? Is it "
                   "applied to both, in the numerator and in the normaliser, and is it positive everywhere?",
})

# Notebooks 04-06's named mistakes (issue 43).
NUDGES.update({
    "sincos_layout": "Write row 1 of the table for embed_dim 4 by hand: which columns hold a sine, which a cosine, "
                     "and which two columns share one angle?",
    "positions": "Which position does each token sit at, counting from 0 and counting the tokens already in the "
                 "cache? Where does your code add that position?",
    "sublayer_missing": "Follow x through your forward: does the result of each sublayer (self.attn, self.mlp) reach "
                        "what you return?",
    "block_chain": "Follow x through the loop over self.blocks: does each block take the previous block's output, "
                   "first to last?",
    "logits": "Which function applies the softmax (or log-softmax) here, and does anything before it already "
              "apply one, or leave it out?",
    "context_limit": "What should happen when a sequence is longer than the model has positions for: should the "
                     "model decide quietly which tokens to drop?",
    "target_shift": "For the input token at position j, which token should the model predict? Write inputs and "
                    "targets of one small window side by side.",
    "loss_reduction": "Which targets count in the loss, and what do you divide their sum by? Count them by hand "
                      "for a batch with padding.",
    "step_order": "Write the five calls of one training step in order: which one computes the gradients, which "
                  "one uses them, and how many times does each run?",
    "greedy": "Which decoding does this exercise ask for: the most likely token every time, or a random draw? "
              "Which line of yours decides?",
    "top_k": "With top_k = 2 and logits [3, 1, 2, 0], which tokens may be drawn, and what probability do the "
             "others get after the softmax?",
    "attention_flops": "Count the attention FLOPs of one token by hand: how many products per head, over how many "
                       "keys, in how many heads and layers, forward and backward?",
    "flops_units": "What does the function return: FLOPs for one token, or for something else? In which unit?",
    "weights_count": "Where does N in 6N come from: the num_weights you are given, or a count of your own?",
    "bias": "Print the layer: which of its projections carry a bias, and does each of your products add it?",
})

# Where one exercise's mistake shares a diagnosis with another's but not its question.
NUDGES.update({
    ("7.1", "split_transpose"): "Conv1D keeps its weight as (in, out), nn.Linear as (out, in): which layout is each "
                                "of your three (E, E) thirds in, and what turns one into the other?",
})
