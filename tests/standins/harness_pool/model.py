"""The stand-in model: what a state / KV block holds after which tokens (:func:`state_value`), the
token sampled after right reads (:func:`next_token`), and the hidden state a request carries through
the layers of a step (:func:`true_output`, :func:`true_hidden`, :func:`sample`)."""

from __future__ import annotations

import hashlib as _hashlib

import numpy as _np


def state_value(tokens, layer: int, rank_key, nbytes: int) -> bytes:
    """The content of layer ``layer``'s state (TP slice ``rank_key``) after ``tokens``."""
    h = _hashlib.blake2b(_np.asarray(tokens, dtype=_np.int64).tobytes(), digest_size=16, person=b"alp-state")
    h.update(f"{layer}/{rank_key}".encode())
    d = h.digest()
    return (d * (nbytes // len(d) + 1))[:nbytes]


def next_token(tokens) -> int:
    """The token the model samples after ``tokens`` when every state and KV block it read was right
    (deterministic, the same on every instance and schedule)."""
    d = _hashlib.blake2b(_np.asarray(tokens, dtype=_np.int64).tobytes(), digest_size=4).digest()
    return 10 + int.from_bytes(d, "little") % 50000


# -------------------------------------------------------------- the stand-in model's hidden state
# Each request carries a hidden state through the layers of a step. A layer's output is a function
# of the hidden state coming in and of the bytes it read (its GDN state, or every computed KV block
# of the request): from right bytes and a right hidden state it is the layer's true output for the
# tokens (the same whatever the chunking, as a real model's would be); from anything else it is a
# hash of the hidden state and of the bytes read. Each TP rank contributes its slice and the slices
# are summed (TP's all-reduce: a real collective over the TP group when ranks are processes), so one
# wrong byte on any rank changes the hidden state of every rank from that layer on, every state and
# KV block written after it, and the token sampled (:func:`sample`).
HIDDEN_BITS = 40
_HIDDEN_MASK = (1 << HIDDEN_BITS) - 1
CORRUPT_TOKEN_BASE = 50010  # a corrupted hidden state samples from [50010, 65536): never a clean token


def _h40(*parts) -> int:
    h = _hashlib.blake2b(digest_size=8, person=b"alp-hidden")
    for part in parts:
        h.update(part if isinstance(part, (bytes, bytearray)) else repr(part).encode())
    return int.from_bytes(h.digest(), "little") & _HIDDEN_MASK


def true_output(tokens, layer: int, rank: int) -> int:
    """Rank ``rank``'s slice of layer ``layer``'s output for the last of ``tokens``, computed from
    right inputs."""
    return _h40("out", _np.asarray(tokens, dtype=_np.int64).tobytes(), layer, rank)


def true_hidden(tokens, layer: int, tp: int) -> int:
    """The all-reduced output of layer ``layer`` from right inputs on every one of ``tp`` ranks."""
    return sum(true_output(tokens, layer, r) for r in range(tp))


def sample(tokens, hidden: int, clean: bool) -> int:
    """The token sampled from the last layer's hidden state."""
    return next_token(tokens) if clean else CORRUPT_TOKEN_BASE + hidden % (65536 - CORRUPT_TOKEN_BASE)


# -------------------------------------------------------------- the stand-in drafter (MTP)
DRAFT_MISS_TOKEN = 50001  # what a draft position the drafter gets wrong proposes (never a clean token)


def draft_tokens(tokens, k: int, ok: bool) -> list[int]:
    """The stand-in MTP drafter's ``k`` proposals after ``tokens`` (the last one just sampled). With
    right reads it proposes the true continuation at the positions a hash of the sequence picks
    (about 3 of 4: a drafter with a real acceptance rate, the same on every instance and schedule);
    from a wrong read it proposes nothing the target samples."""
    out, seq = [], list(tokens)
    for j in range(k):
        true = next_token(seq)
        right = ok and _h40("draft", _np.asarray(seq, dtype=_np.int64).tobytes(), j) % 4 != 0
        out.append(true if right else DRAFT_MISS_TOKEN + j)
        seq.append(true)
    return out


# -------------------------------------------------------------- a GDN state's two tensors
# A GDN layer's state block holds a conv state (SD layout: ``CONV_ROWS`` rows of positions, each row
# the layer's dim) and a temporal (SSM) state. The temporal state after ``n`` tokens is one value;
# the conv state's row q holds the input of one position, the one ending token count ``c_q = n -
# (CONV_WINDOW - 1) + q``: rows [0, CONV_WINDOW) are the window the kernel reads, the rows after it
# the positions of the draft tokens a speculative step computes (vLLM's conv state is ``kernel - 1 +
# num_speculative_tokens`` wide). So the copies vLLM makes of a speculative step's states mean what
# they mean on a device: the temporal state of draft slot j is the state after ``n + j`` tokens, and
# the conv state shifted by j rows (``get_conv_copy_spec``'s offset ``num_accepted - 1``) is the
# window ending at ``n + j`` tokens. A read at offset o checks rows [o, o + CONV_WINDOW).
CONV_ROWS = 8
CONV_WINDOW = CONV_ROWS - 3  # room for 3 draft positions: the harness's MTP goes up to 3 tokens


def conv_rows(seq, n: int, layer: int, rank_key, row_bytes: int) -> list[bytes]:
    """The conv state's rows for the window ending at ``n`` tokens of ``seq`` (the rows after the
    window cover ``seq``'s tokens after ``n``: a speculative step's drafts, or nothing known yet)."""
    rows = []
    for q in range(CONV_ROWS):
        c = n - (CONV_WINDOW - 1) + q
        rows.append(state_value(seq[: max(c, 0)], layer, f"{rank_key}/conv{c}", row_bytes))
    return rows


def temporal_value(seq, n: int, layer: int, rank_key, nbytes: int) -> bytes:
    """The temporal (SSM) state after the first ``n`` tokens of ``seq``."""
    return state_value(seq[:n], layer, f"{rank_key}/ssm", nbytes)
