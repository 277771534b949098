"""Token sampling on the device: greedy, temperature, top-k, top-p, min-p, penalties, logit bias,
minimum lengths, grammar masks and log-probabilities, per request.

Each row has its own parameters (arrays, so one executable serves every mix of settings) and
its own key, derived from the request's seed and the position being sampled: a request's
output does not depend on what else is in the batch.

Three samplers share these arrays. `sample_plain` (greedy or temperature alone: no sort of the
vocabulary) is the engine's decode step's while no row asks for more; `sample` (temperature,
top-k, top-p) is the decode step's for rows with those filters, and what prefill chunks use.
`sample_full` first processes the logits as each row asks
— repetition penalty over the prompt and output tokens (divides positive logits, multiplies
negative ones, as Hugging Face's), frequency and presence penalties over the output tokens
(OpenAI's definitions), the logit bias, stop tokens banned until `min_tokens` are out, a
grammar's token bitmask — then samples with min-p besides, and returns the log-probabilities of
the chosen token and of the most likely ones under the model's own (unprocessed) distribution.
Neutral values (penalties 0 or 1, no bias, an all-ones mask) leave a row's distribution as it is.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

TOP_LOGPROBS = 20  # the most likely tokens whose log-probabilities a step returns (OpenAI's limit)
MAX_LOGIT_BIAS = 300  # logit_bias entries per request
MAX_STOP_TOKENS = 96  # tokens a request's min_tokens keeps out (its stop tokens and EOS)
NO_TOKEN = np.iinfo(np.int32).max  # padding of the token-id arrays (out of range: scatters drop it)


class RequestError(ValueError):
    """A request that cannot be served as given; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class GenerationParams:
    """What one request asks for."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit)
    min_tokens: int = 0  # stop tokens (and EOS) are kept out until this many tokens are generated
    logprobs: int | None = None  # None: none; n: the chosen token's log-probability and the n most likely tokens'
    # None: none; n: each prompt token's log-probability after the tokens before it, and the n
    # most likely tokens' there (the first token has none). The prompt is then prefilled whole,
    # never read from the prefix cache.
    prompt_logprobs: int | None = None

    @property
    def processed(self) -> bool:
        """Whether its tokens need `sample_full` (anything beyond temperature, top-k, top-p)."""
        return bool(
            self.min_p or self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1 or self.logit_bias
            or self.min_tokens or self.logprobs is not None
        )  # fmt: skip

    @property
    def filters(self) -> bool:
        """Whether it samples with top-k or top-p (`sample`, which sorts the vocabulary) rather than
        greedily or with a temperature alone (`sample_plain`)."""
        return bool(self.temperature > 0 and (self.top_k or self.top_p < 1))

    def check(self, prompt: Sequence[int], vocab_size: int, max_context: int) -> list[int]:
        """The prompt as a list of ints, or `RequestError` saying what is wrong."""
        ids = [int(t) for t in prompt]
        if not ids:
            raise RequestError("the prompt is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"token ids out of range [0, {vocab_size}): {bad[:8]}")
        if self.max_new_tokens <= 0:
            raise RequestError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        total = len(ids) + self.max_new_tokens
        if total > max_context:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({self.max_new_tokens}) = {total} exceeds the configured "
                f"context of {max_context} tokens (EngineConfig.max_context)"
            )
        if not (0 <= self.temperature < math.inf and 0 < self.top_p <= 1 and 0 <= self.top_k <= vocab_size):  # NaN fails too
            raise RequestError(f"need 0 <= temperature < inf, 0 < top_p <= 1 and 0 <= top_k <= {vocab_size} (the vocabulary)")
        if not (0 <= self.min_p <= 1 and -2 <= self.presence_penalty <= 2 and -2 <= self.frequency_penalty <= 2):
            raise RequestError("need 0 <= min_p <= 1, -2 <= presence_penalty <= 2 and -2 <= frequency_penalty <= 2")
        if not 0 < self.repetition_penalty <= 10:
            raise RequestError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"stop token ids out of range [0, {vocab_size}): {bad[:8]}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        bad = [t for t, b in self.logit_bias if not 0 <= t < vocab_size or not -100 <= b <= 100]
        if bad:
            raise RequestError(f"logit_bias needs token ids in [0, {vocab_size}) and biases in [-100, 100]: {bad[:8]}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise RequestError(f"min_tokens must be in [0, max_new_tokens = {self.max_new_tokens}], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= TOP_LOGPROBS:
            raise RequestError(f"logprobs (the most likely tokens to return) must be in [0, {TOP_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= TOP_LOGPROBS:
            raise RequestError(
                f"prompt_logprobs (the most likely tokens to return) must be in [0, {TOP_LOGPROBS}], got {self.prompt_logprobs}"
            )
        sampling_row(self)  # every value fits the step's arrays
        return ids

    def stop_set(self, eos_token_ids: Iterable[int]) -> frozenset:
        """The tokens that end this request: its stop tokens, and EOS unless `ignore_eos`."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampling:
    """Per-row sampling parameters (module docstring; `sample` reads the first four)."""

    seeds_B: jax.Array  # uint32
    temperature_B: jax.Array  # float32, <= 0: greedy
    top_k_B: jax.Array  # int32, <= 0: off
    top_p_B: jax.Array  # float32, >= 1: off
    min_p_B: jax.Array  # float32, 0: off
    presence_B: jax.Array  # float32
    frequency_B: jax.Array  # float32
    repetition_B: jax.Array  # float32, 1: off
    bias_ids_BK: jax.Array  # int32 [B, MAX_LOGIT_BIAS], NO_TOKEN: padding
    bias_BK: jax.Array  # float32
    ban_ids_BS: jax.Array  # int32 [B, MAX_STOP_TOKENS]: tokens kept out while the step's input position < ban_until
    ban_until_B: jax.Array  # int32

    @classmethod
    def greedy(cls, batch: int) -> Sampling:
        return sampling_rows([None] * batch)


SamplingRow = tuple  # one row of each array of `Sampling`, as the step's dtypes take them


def sampling_row(p: GenerationParams | None, prompt_len: int = 0, eos_token_ids: Iterable[int] = ()) -> SamplingRow:
    """One row of the sampling arrays (None: greedy) for a prompt of `prompt_len` tokens; raises
    where a value does not fit its dtype, so that a request is refused before it shares a step."""
    p = p or GenerationParams()
    seed, top_k = int(p.seed), int(p.top_k)
    if not (0 <= seed < 1 << 32 and 0 <= top_k < 1 << 31):
        raise RequestError(f"seed must be in [0, 2^32) and top_k in [0, 2^31), got {seed} and {top_k}")
    bias_ids, bias = np.full(MAX_LOGIT_BIAS, NO_TOKEN, np.int32), np.zeros(MAX_LOGIT_BIAS, np.float32)
    for j, (t, b) in enumerate(p.logit_bias):
        bias_ids[j], bias[j] = t, b
    ban, ban_until = np.full(MAX_STOP_TOKENS, NO_TOKEN, np.int32), 0
    if p.min_tokens:
        stops = sorted(p.stop_set(eos_token_ids))
        if len(stops) > MAX_STOP_TOKENS:
            raise RequestError(f"min_tokens can keep out at most {MAX_STOP_TOKENS} stop tokens, this request has {len(stops)}")
        ban[: len(stops)] = stops
        ban_until = prompt_len - 1 + p.min_tokens  # the input position of the step that samples output token min_tokens
    f32 = np.float32
    return (np.uint32(seed), f32(p.temperature), np.int32(top_k), f32(p.top_p), f32(p.min_p), f32(p.presence_penalty),
            f32(p.frequency_penalty), f32(p.repetition_penalty), bias_ids, bias, ban, np.int32(ban_until))  # fmt: skip


def sampling_rows(rows: Sequence[SamplingRow | GenerationParams | None]) -> Sampling:
    """Per-row sampling arrays from rows made by `sampling_row` (or parameters, or None:
    greedy)."""
    rows = [r if isinstance(r, tuple) else sampling_row(r) for r in rows]
    n = len(dataclasses.fields(Sampling))
    return Sampling(*(jnp.asarray(np.stack([r[j] for r in rows])) for j in range(n)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Logprobs:
    """Log-probabilities under the model's distribution at one step: the sampled token's and
    the `TOP_LOGPROBS` most likely tokens' (most likely first). A prompt's (`steps.chunk_logprobs`)
    have a position axis after the row's: [B, T] and [B, T, N]."""

    chosen_B: jax.Array  # float32
    top_ids_BN: jax.Array  # int32
    top_BN: jax.Array  # float32


def _gumbel(seeds_B, positions_B, V: int) -> jax.Array:
    """Each row's Gumbel noise over the vocabulary [B, V], by token id, from its seed and the
    position being sampled: a token's noise does not depend on which filters a row asks for."""
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.PRNGKey(s), p))(seeds_B, positions_B)
    return jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(keys)


def sample_plain(logits_BV, seeds_B, positions_B, temperature_B) -> jax.Array:
    """`sample` for rows without top-k, top-p or min-p: greedy at temperature <= 0, else the
    token whose scaled logit plus its Gumbel noise is largest — the token `sample` draws for the
    same row with its filters off, without sorting the vocabulary."""
    greedy = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    scaled = logits_BV / jnp.maximum(temperature_B, 1e-6)[:, None]
    tok = jnp.argmax(scaled + _gumbel(seeds_B, positions_B, logits_BV.shape[-1]), axis=-1).astype(jnp.int32)
    return jnp.where(temperature_B > 0, tok, greedy)


def sample(logits_BV, seeds_B, positions_B, temperature_B, top_k_B, top_p_B, min_p_B=None) -> jax.Array:
    """Next token per row. temperature <= 0 means greedy; top_k <= 0, top_p >= 1 and min_p <= 0
    disable those filters (min-p keeps tokens at least `min_p` times as likely as the most likely
    one after temperature). Among the tokens the filters keep, the one whose scaled logit plus its
    Gumbel noise (`_gumbel`) is largest: a draw from their renormalised distribution."""
    greedy = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    # Both paths run and each row selects: a `lax.cond` on "any row samples" would skip the sort
    # for greedy batches, but XLA's GPU runtime reads a conditional's predicate on the host, so
    # the step's call would return only when the step is done and the next call could not be
    # dispatched while this one runs (on the H200, offload batch 1: 90.9 -> 60.2 ms per step).
    V = logits_BV.shape[-1]
    scaled = logits_BV / jnp.maximum(temperature_B, 1e-6)[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_l = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(V)[None, :]
    keep = (top_k_B[:, None] <= 0) | (rank < top_k_B[:, None])
    if min_p_B is not None:
        keep &= sorted_l >= sorted_l[:, :1] + jnp.log(min_p_B)[:, None]
    probs = jax.nn.softmax(jnp.where(keep, sorted_l, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each candidate
    keep &= (before < top_p_B[:, None]) | (rank == 0)
    noise = jnp.take_along_axis(_gumbel(seeds_B, positions_B, V), order, axis=-1)
    pick = jnp.argmax(jnp.where(keep, sorted_l + noise, -jnp.inf), axis=-1)
    tok = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature_B > 0, tok, greedy)


def unpack_mask(mask_BW, V: int) -> jax.Array:
    """A token bitmask [B, ceil(V / 32)] (bit j of word w allows token 32 w + j) as bool [B, V]."""
    idx = jnp.arange(V)
    return ((mask_BW[:, idx // 32] >> (idx % 32).astype(mask_BW.dtype)) & 1).astype(bool)


def process_logits(logits_BV, s: Sampling, counts_BV, positions_B, mask_BW=None) -> jax.Array:
    """The logits each row samples from (module docstring). `counts_BV`: 2 × the token's count
    among the row's output tokens, plus 1 if it is in the prompt; `positions_B`: the step's input
    positions; `mask_BW`: the grammar bitmask (`unpack_mask`), None: everything allowed."""
    B, V = logits_BV.shape
    x = logits_BV.astype(jnp.float32)
    out = (counts_BV >> 1).astype(jnp.float32)
    rep = s.repetition_B[:, None]
    x = jnp.where(counts_BV > 0, jnp.where(x > 0, x / rep, x * rep), x)
    x = x - s.frequency_B[:, None] * out - s.presence_B[:, None] * (out > 0)
    rows = jnp.arange(B)[:, None]
    x = x.at[rows, s.bias_ids_BK].add(s.bias_BK, mode="drop")
    ban = jnp.where((positions_B < s.ban_until_B)[:, None], s.ban_ids_BS, NO_TOKEN)
    x = x.at[rows, ban].set(-jnp.inf, mode="drop")
    if mask_BW is not None:
        x = jnp.where(unpack_mask(mask_BW, V), x, -jnp.inf)
    return x


def sample_full(logits_BV, s: Sampling, counts_BV, positions_B, mask_BW=None, logprobs: bool = True) -> tuple[jax.Array, Logprobs | None]:
    """The next token of each row from its processed logits (`process_logits`, then `sample`
    with min-p), and (with `logprobs`) its `Logprobs` under the unprocessed ones."""
    x = process_logits(logits_BV, s, counts_BV, positions_B, mask_BW)
    tok = sample(x, s.seeds_B, positions_B + 1, s.temperature_B, s.top_k_B, s.top_p_B, s.min_p_B)
    return tok, (logprobs_of(logits_BV, tok) if logprobs else None)


def logprobs_of(logits, tokens) -> Logprobs:
    """`Logprobs` of `tokens` (any leading shape) under `logits` ([..., V]): each token's
    log-probability and the `TOP_LOGPROBS` most likely tokens' ([..., N])."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top, top_ids = jax.lax.top_k(lp, min(TOP_LOGPROBS, lp.shape[-1]))
    return Logprobs(jnp.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0], top_ids.astype(jnp.int32), top)


def count_tokens(counts_BV, tokens_B, rows_B) -> jax.Array:
    """`counts_BV` with each of `rows_B`'s token counted once more as output."""
    B = counts_BV.shape[0]
    return counts_BV.at[jnp.arange(B), tokens_B].add(jnp.where(rows_B, 2, 0).astype(counts_BV.dtype), mode="drop")


def prompt_counts(prompt: Sequence[int], vocab_size: int) -> np.ndarray:
    """A row of the counts array for a request about to sample its first token: 1 where a token
    is in the prompt (no output yet)."""
    row = np.zeros(vocab_size, np.int32)
    row[np.asarray(prompt, np.int64)] = 1
    return row
