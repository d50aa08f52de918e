"""The first hint after a failed check: a nudge written for the mistake its diagnosis names.

A nudge asks the question that leads to the fix, without the fix (the check's message already
says what is wrong; the spec's hints say how to write it).
"""
from __future__ import annotations

NUDGES = {
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
    "residual": "Write the block as two lines of the form x = x + f(norm(x)): which one differs in yours?",
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
    "mismatch": "Compare your output with the reference's on the smallest input where they differ (the next "
                "hint shows one): which entries are wrong, and by how much?",
}


def nudge(diagnosis: str) -> str:
    return NUDGES.get(diagnosis, NUDGES["mismatch"])
