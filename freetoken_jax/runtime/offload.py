"""Expert execution with the experts in host memory (strategy "offload").

Decode: per MoE layer, `find_misses` finds what the routed experts miss in the unified slot
cache (and, strategy "hybrid", which of them the CPU computes), `place_misses` maps the misses to
victim slots (`place_layer`: both in one kernel, on a GPU where the step's victims come from one
sort), the Pallas fetch kernel copies them from the host banks into those slots (in place, on
the donated slot arrays), and the experts are computed from the slots.

Prefill (many tokens touch most experts of a layer) loads whole layers. With at least 2E slots
it borrows the 2E least recently used slots as two layer buffers (`borrow_for_prefill` empties
them): layer L+1 is loaded into one while layer L computes; experts already resident in the
cache are used where they are (not sent again, not even copied) and the rest fetched from the
host bank into the buffer by the Pallas kernel, or (`prefill_load`, on a GPU by default) the
whole bank moves as one in-jit copy, which XLA runs on its own stream beside layer L's compute,
and layer L+1 computes from that copy as it is ("copy2": layers L+1 and L+2 in flight, so that
the copies run back to back while a layer's compute takes nearly as long as its copy). At the
end the last two layers' experts stay resident in their buffers (`keep_buffer`; a copied bank of
theirs is written into its buffer).
Without 2E slots each layer's whole bank is copied to the device, used and dropped, and the
slot cache is left as it was.

Under this strategy the experts' parameters in the weights tree are the host banks themselves,
one per MoE layer and weight kind, each expert one flattened row ([E, F·D] for gate and up,
[E, D·F] for down) — the layout of the slot arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from freetoken_jax.config import COPY_LOADS, MoEModelConfig, env_choice
from freetoken_jax.memory.slot_cache import (
    SlotCache,
    borrow_for_prefill,
    find_misses,
    keep_buffer,
    place_kernel,
    place_layer,
    place_misses,
    record_stats,
    step_victims,
)
from freetoken_jax.models.routed import pair_biases, routed_experts
from freetoken_jax.quant.layout import ExpertLayout
from freetoken_jax.runtime import bank_copy
from freetoken_jax.runtime.bank_copy import streams
from freetoken_jax.runtime.experts import moe_layer_fns
from pallas_kernels.expert_fetch import fetch_rows_many

KINDS = ("gate", "up", "down")
SMALL_ROW_BYTES = 256 << 10  # below this, a layer's bank moves as one copy


def host_memory_kind() -> str | None:
    """`pinned_host` where a GPU reads host memory over PCIe; None (default memory) on the CPU
    backend, where host memory is device memory and Pallas interpret mode refuses pinned_host."""
    return "pinned_host" if jax.default_backend() == "gpu" else None


def copy_wait() -> str:
    """Where a buffered prefill's compute first waits for a bank copied whole, layer m+1's
    (FREETOKEN_PREFILL_COPY_WAIT): "experts" (the default) — layer m+1's experts (the barrier
    that issues layer m+2's copy), so that layer m+1's attention runs under the copy and m+2's
    copy can follow m+1's at once; "output" — layer m's output, so that layer m+1's attention
    starts once its bank has landed and layer m+2's copy, issued after that attention, waits for
    it too (on the H200 an 8192-token q4_0 chunk took 213 ms this way against 193: RESULTS.md).
    The last two layers' banks, written into their buffers, wait as "output"."""
    return env_choice("FREETOKEN_PREFILL_COPY_WAIT", "experts", ("experts", "output"))


COPY_SPLITS = {"none": (), "down": (2,), "up_down": (1, 2)}  # bank kinds (0 gate, 1 up, 2 down) issued late


def copy_split() -> tuple[int, ...]:
    """Which of layer m+2's banks a copy2 prefill issues at layer m's output rather than
    at its experts' barrier (FREETOKEN_PREFILL_COPY_SPLIT): "down" (the default) — the down bank;
    "up_down" — up and down; "none" — all three at the barrier. XLA's compiled schedule keeps at
    most two copies outstanding and places each copy's wait soon after its start (RESULTS.md), so
    three starts at one point hold the compute there until the first copy has landed; starts at
    two points give each copy a stretch of compute to run under (H100, an 8192-token q4_0 chunk
    under copy2: 180-182 ms with "down", 186 with "up_down", 184-185 with "none")."""
    return COPY_SPLITS[env_choice("FREETOKEN_PREFILL_COPY_SPLIT", "down", tuple(COPY_SPLITS))]


def slot_prefill_pays(cfg: MoEModelConfig, tokens: int, num_slots: int) -> bool:
    """Whether a prefill chunk of `tokens` (rows × chunk length) should go through the slot cache
    token by token rather than load whole layers: when its routed experts fit in the slots and,
    routed uniformly, would reach at most 90% of a layer's experts (so that fetching just those
    moves less than a whole layer; e.g. up to 35 tokens for 8 of 128 experts)."""
    k, E = cfg.top_k, cfg.num_experts
    return tokens * k <= num_slots and (1 - k / E) ** tokens >= 0.1


# A chunk of the `cpu` strategy goes to the device (each layer's bank copied in) when it routes at
# least this many pairs an expert on average: 64 tokens at 128 experts, top-8. There the CPU's
# int8 products of one layer (8 × 64 pairs of 9.4 MFLOP at Qwen3-30B-A3B's shape, a few TFLOP/s on
# 16 cores) take about as long as the layer's q4_0 bank takes over PCIe (340 MB at 50 GB/s,
# 6.8 ms); a longer chunk's products grow with it, the copy does not.
CPU_PREFILL_PAIRS = 4


def device_prefill_pays(cfg: MoEModelConfig, tokens: int) -> bool:
    """Whether strategy `cpu` computes a prefill chunk of `tokens` (rows × length) on the device."""
    return tokens * cfg.top_k >= CPU_PREFILL_PAIRS * cfg.num_experts


class OffloadExecutor:
    """Builds each MoE layer's expert function for one traced step, threading the slot cache
    through the layers (`self.cache` holds the latest version while tracing)."""

    def __init__(
        self,
        cfg: MoEModelConfig,
        model,
        cache: SlotCache | None,
        valid_T: jax.Array,
        hybrid_q: float | None = None,
        host_banks=None,
        handoff: str = "callback",
        hybrid_overhead: float = 0.0,
        prefill: bool = False,
        prefill_load: str = "auto",
        compute=None,
    ):
        self.cfg, self.cache, self.valid_T = cfg, cache, valid_T
        self.hybrid_q, self.host_banks, self.handoff, self.hybrid_overhead = hybrid_q, host_banks, handoff, hybrid_overhead
        self.prefill, self.prefill_load = prefill, prefill_load
        self.compute = compute or routed_experts
        self.stats: list = []  # each decode layer's `LayerStats`, recorded by `result`
        self.victims = None  # the step's `StepVictims`, left by each decode layer for the next
        if cache is not None and not prefill:
            self.victims = step_victims(cache, cfg.num_moe_layers, valid_T.shape[0] * cfg.top_k)
        self.layouts = [ExpertLayout.of(cfg, m) for m in range(cfg.num_moe_layers)]
        if prefill:  # without a cache (strategy cpu's chunks on the device) every bank is copied in
            if cache is not None:
                self.cache, self.buffers = borrow_for_prefill(cache, cfg.num_experts)
            self.layer_slots: dict = {}  # MoE layer -> the slot of each of its experts
            self.layer_banks: dict = {}  # MoE layer -> its bank copied to the device, computed from as it is
            self.in_flight: dict = {}  # MoE layer -> its bank's copy issued ahead, not yet taken up
        self.banks = [
            (layer.mlp.experts.gate[...], layer.mlp.experts.up[...], layer.mlp.experts.down[...]) for layer in model.layers if layer.is_moe
        ]
        self.interpret = jax.default_backend() == "cpu"
        # whole-bank copies on the C++ module's copy stream where asked and the banks' views are here
        self.stream = prefill and host_banks is not None and streams()

    def result(self) -> SlotCache | None:
        """The slot cache after the step's last layer, its layers' statistics recorded."""
        return None if self.cache is None else record_stats(self.cache, self.stats)

    def expert_fns(self, model) -> list:
        if self.prefill:
            return moe_layer_fns(model, self._buffered_prefill_fn)
        return moe_layer_fns(model, self._prefill_fn if self.cache is None else self._decode_fn)

    def _copies_bank(self, m: int) -> bool:
        """Whether layer m's whole bank comes in by one in-jit `device_put` ("copy", "copy2": the
        next two layers' banks in flight) rather than the Pallas fetch of its missing experts.
        "auto" (the engine resolves it from its memory plan first:
        `memory.budget.choose_prefill_load`): always on a GPU, where XLA runs the
        copy on its own stream beside the compute while the fetch kernel runs on the compute
        stream, in series with it (H200: a 2048-token q4_0 chunk 316 against 381 ms); on the
        CPU backend for rows under 256 KB; always without a slot cache (strategy cpu's chunks)."""
        row = self.banks[m][0].shape[1] * self.banks[m][0].dtype.itemsize
        auto = host_memory_kind() is not None or row < SMALL_ROW_BYTES
        return self.cache is None or self.prefill_load in COPY_LOADS or (self.prefill_load == "auto" and auto)

    def _fetch_layer(self, m: int) -> None:
        """Brings MoE layer m's experts in by the Pallas fetch: the resident ones are used where
        they are, the rest fetched into the buffer `buffers[m % 2]`. Records in
        `self.layer_slots[m]` the slot of each of its experts."""
        E, c, buf = self.cfg.num_experts, self.cache, self.buffers[m % 2]
        idx = jnp.arange(E, dtype=jnp.int32)
        s = c.slot_for_id[m * E + idx]
        resident = s >= 0  # elsewhere: borrowing emptied the buffers
        out = fetch_rows_many(self.banks[m], (c.gate_SR, c.up_SR, c.down_SR), idx, buf, ~resident, interpret=self.interpret)
        self.cache = c.with_(gate_SR=out[0], up_SR=out[1], down_SR=out[2])
        self.layer_slots[m] = jnp.where(resident, s, buf)

    def _place_copy(self, m: int, copied) -> None:
        """Writes layer m's whole bank, already copied to the device, into `buffers[m % 2]`."""
        c, buf = self.cache, self.buffers[m % 2]
        out = [arr.at[buf, : b.shape[1]].set(b) for b, arr in zip(copied, (c.gate_SR, c.up_SR, c.down_SR))]
        self.cache = c.with_(gate_SR=out[0], up_SR=out[1], down_SR=out[2])
        self.layer_slots[m] = buf

    def _take_copy(self, m: int, copied) -> None:
        """Layer m's bank, copied to the device whole, is computed from as it is; only the last two
        layers', which stay resident after the prefill (`keep_buffer`), are written into their
        buffers (a bank's scatter into the slot arrays and the gather back out cost as much as a
        third of a 2048-token chunk's compute on the H200)."""
        if m >= len(self.banks) - 2 and self.cache is not None:
            self._place_copy(m, copied)
        else:
            self.layer_banks[m] = tuple(copied)

    def _buffered_prefill_fn(self, m: int):
        def fn(x_TD, ids_TK, w_TK, bias=None):
            n = len(self.banks)
            # copy2: two layers ahead, layer m+2's `copy_split` kinds issued after layer m's output
            # (one layer ahead they would have only the next layer's attention to run under; the
            # copy stream runs its copies in the order issued, so it splits none)
            ahead = 2 if self.prefill_load == "copy2" else 1  # (copy2 copies every bank)
            newest, late = m + ahead, copy_split() if ahead == 2 and not self.stream else ()
            if m == 0:
                if self._copies_bank(0):
                    self._issue([(0, k) for k in range(3)], self.banks[0], x_TD)
                    self._take_copy(0, self._landed(self._pop_in_flight(0), x_TD))
                else:
                    self._fetch_layer(0)
            if m in self.layer_banks:
                layer = self._landed(self.layer_banks.pop(m), x_TD)
            else:
                c, slots = self.cache, self.layer_slots.pop(m)
                layer = tuple(a[slots] for a in (c.gate_SR, c.up_SR, c.down_SR))
            if m + 1 < n:
                # The next layers' loads are issued once layer m's input and weights exist, and
                # before it computes: the two may overlap, and the loads cannot run ahead of the
                # compute (XLA would otherwise start every layer's load at once, keeping a version
                # of the slot arrays alive for each). Banks copied whole go through the barrier too;
                # under "copy2" layer m+2's is issued here, m+1's having been issued at layer m-1.
                issue = [
                    (j, k)
                    for j in range(m + 1, min(n, m + 1 + ahead))
                    if self._copies_bank(j)
                    for k in range(3)
                    if k not in self.in_flight.get(j, {}) and not (j == newest and k in late)
                ]
                nxt = tuple(self.banks[j][k] for j, k in issue)
                if self.stream:  # the copies start here; the barrier ties the compute behind their starts
                    tokens = self._issue(issue, nxt, x_TD)
                    x_TD, layer, self.cache, _ = jax.lax.optimization_barrier((x_TD, layer, self.cache, tokens))
                else:
                    x_TD, layer, self.cache, nxt = jax.lax.optimization_barrier((x_TD, layer, self.cache, nxt))
                    self._issue(issue, nxt)
                if m + 1 not in self.in_flight:
                    self._fetch_layer(m + 1)
            out = self.compute(x_TD, ids_TK, w_TK, layer, self.layouts[m], bias=pair_biases(bias, ids_TK))
            if late and newest < n and self._copies_bank(newest):
                issue = [(newest, k) for k in late]
                out, nxt = jax.lax.optimization_barrier((out, tuple(self.banks[j][k] for j, k in issue)))
                self._issue(issue, nxt)
            copied = self._pop_in_flight(m + 1)
            if copied is not None:
                # A copied bank is taken up at the next layer's experts (or, `copy_wait`, after
                # this layer's output), so that nothing on the compute stream waits for it before.
                if copy_wait() == "output" or m + 1 >= n - 2:
                    if self.stream:
                        copied = self._landed(copied, out)
                    else:
                        out, copied = jax.lax.optimization_barrier((out, copied))
                self._take_copy(m + 1, copied)
            if m == n - 1 and self.cache is not None:  # the last two layers' experts stay resident
                for last in range(max(0, n - 2), n):
                    self.cache = keep_buffer(self.cache, self.buffers[last % 2], last)
            return out

        return fn

    def _issue(self, issue: list, host: tuple, dep=None) -> tuple:
        """Copies the host banks `host` (MoE layer, kind) of `issue` to the device, in flight. On
        the copy stream (`self.stream`) each copy starts once `dep` exists; returns the starts'
        tokens, to tie what must follow them."""
        tokens = []
        for (j, k), bank in zip(issue, host):
            if self.stream:
                copy = bank_copy.start(self.host_banks[j][k], dep)
                tokens.append(copy.token)
            else:
                copy = self._on_device(bank)
            self.in_flight.setdefault(j, {})[k] = copy
        return tuple(tokens)

    def _pop_in_flight(self, j: int) -> list | None:
        """Layer j's banks in flight (gate, up, down), no longer counted as in flight; None if none are."""
        copies = self.in_flight.pop(j, None)
        return None if copies is None else [copies[k] for k in range(3)]

    @staticmethod
    def _landed(banks, dep) -> tuple:
        """A layer's copied banks, each waited for (after `dep`) where it is still on the copy stream."""
        return tuple(bank_copy.wait(b, dep) if isinstance(b, bank_copy.InFlight) else b for b in banks)

    @staticmethod
    def _on_device(bank):
        if host_memory_kind() is None:
            return bank
        return jax.device_put(bank, jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device"))

    def _decode_fn(self, m: int):
        cpu = None
        if self.hybrid_q is not None:
            from freetoken_jax.runtime.cpu_executor import hybrid_threads

            cpu = CpuExpertExecutor(self.cfg, self.host_banks, self.valid_T, self.handoff, hybrid_threads()).layer(m)

        def fn(x_TD, ids_TK, w_TK, bias=None):
            T, K = ids_TK.shape
            E = self.cfg.num_experts

            def fetch_and_compute(c, slots_TK, plan, stats, w_gpu):
                self.stats.append(stats)
                arrays = (c.gate_SR, c.up_SR, c.down_SR)
                fetched = fetch_rows_many(self.banks[m], arrays, plan.src_N, plan.dst_N, plan.valid_N, interpret=self.interpret)
                self.cache = c.with_(gate_SR=fetched[0], up_SR=fetched[1], down_SR=fetched[2])
                return self.compute(x_TD, slots_TK, w_gpu, tuple(fetched), self.layouts[m], bias=pair_biases(bias, ids_TK))

            if self.victims is not None and place_kernel(T * K, self.victims.slot_W.shape[0]):
                # the layer's misses found and placed by one kernel, then the CPU job started
                start, slots_TK, plan, stats, self.victims, on_cpu = place_layer(self.cache, m, ids_TK, self.valid_T, E, self.victims,
                                                                                 self.hybrid_q, self.hybrid_overhead)  # fmt: skip

                def gpu_side(c):
                    return fetch_and_compute(c, slots_TK, plan, stats, w_gpu)
            else:
                # the CPU job starts as soon as the layer knows its misses; choosing victims, the
                # fetch and the GPU experts run between its submit and its wait, so they overlap it
                misses = find_misses(self.cache, m, ids_TK, self.valid_T, E, self.hybrid_q, self.hybrid_overhead)
                start, on_cpu = self.cache, misses.on_cpu.reshape(T, K)

                def gpu_side(c):
                    c, slots_TK, plan, stats, self.victims = place_misses(c, m, misses, E, T, K, self.victims)
                    return fetch_and_compute(c, slots_TK, plan, stats, w_gpu)

            w_gpu = w_TK if cpu is None else jnp.where(on_cpu, 0.0, w_TK)  # (gpu_side reads it when called)
            if cpu is None:
                return gpu_side(start)
            gpu, host = cpu.around(x_TD, ids_TK, jnp.where(on_cpu, w_TK, 0.0), self.valid_T, gpu_side, start)
            return (gpu.astype(jnp.float32) + host).astype(x_TD.dtype)

        return fn

    def _prefill_fn(self, m: int):
        def fn(x_TD, ids_TK, w_TK, bias=None):
            banks = [self._on_device(b) for b in self.banks[m]]
            return self.compute(x_TD, ids_TK, w_TK, tuple(banks), self.layouts[m], bias=pair_biases(bias, ids_TK))

        return fn


def host_bank_placer():
    """`place(path, array)`: puts a layer's stacked experts into a host bank (one flattened row
    per expert) and frees the device copy; other leaves go to the device."""
    from freetoken_jax.models import is_expert_path

    dev = jax.devices()[0]
    kind = host_memory_kind()
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind=kind) if kind else jax.sharding.SingleDeviceSharding(dev)

    def place(path, a):
        if not is_expert_path(path):
            return jnp.asarray(a)
        bank = jax.device_put(a.reshape(a.shape[0], -1), host)
        bank.block_until_ready()
        if isinstance(a, jax.Array) and not a.is_deleted() and a.unsafe_buffer_pointer() != bank.unsafe_buffer_pointer():
            a.delete()  # the device copy (on the CPU backend a bank may be the same buffer)
        return bank

    return place


def to_host_banks(params):
    """`params` with every MoE layer's stacked experts moved into host banks, one layer at a time."""
    from flax import nnx

    place = host_bank_placer()
    return nnx.State.from_flat_path([(p, v.replace(place(p, v.get_value()))) for p, v in params.flat_state()])


class _Static(tuple):
    """Host bank views carried as static jit metadata: hashed and compared by identity (the
    arrays themselves are never traced)."""

    def __hash__(self):
        return id(self)

    def __eq__(self, other):
        return self is other


def host_bank_views(params) -> tuple:
    """Numpy views (no copies) of every MoE layer's host banks, (gate, up, down) per layer, for
    the CPU executor, followed by host copies of the layer's expert biases (gate, up, down) where
    it has them; static metadata of `Weights`."""
    from freetoken_jax.runtime.cpu_executor import host_view

    def layer_views(experts):
        banks = tuple(host_view(experts[k].get_value()) for k in ("gate", "up", "down"))
        if "bias" not in experts:
            return banks
        return banks + tuple(np.asarray(experts["bias"][k].get_value(), np.float32) for k in ("gate", "up", "down"))

    return _Static(layer_views(experts) for experts in moe_experts(params))


def moe_experts(params):
    """Each MoE layer's `experts` state in the weights tree `params`, in layer order."""
    return (layer["mlp"]["experts"] for _, layer in sorted(params["layers"].items()) if "experts" in layer["mlp"])


class CpuExpertExecutor:
    """Strategy "cpu": every routed expert computed by the C++ executor straight from the host
    banks (no slots on the device at all); also the CPU share of strategy "hybrid"."""

    def __init__(self, cfg: MoEModelConfig, host_banks: list, valid_T: jax.Array, mode: str = "callback", threads: int | None = None):
        self.cfg, self.host_banks, self.valid_T, self.mode, self.threads = cfg, host_banks, valid_T, mode, threads

    def expert_fns(self, model) -> list:
        def make(m):
            h = self.layer(m)
            # the layer's biases reach the executor as host copies (`host_bank_views`)
            return lambda x_TD, ids_TK, w_TK, bias=None: h.collect(h.submit(x_TD, ids_TK, w_TK, self.valid_T), x_TD.shape[0]).astype(
                x_TD.dtype
            )

        return moe_layer_fns(model, make)

    def layer(self, m: int):
        from freetoken_jax.runtime.handoff import LayerHandoff

        cfg = self.cfg
        gate, up, down, *bias = self.host_banks[m]
        return LayerHandoff(self.mode, gate, up, down, cfg.hidden_dim, cfg.moe_intermediate_dim, cfg.hidden_act,
                            ExpertLayout.of(cfg, m).executor_format(), self.threads, tuple(bias) or None)  # fmt: skip
