"""A rank's step: ``NPUModelRunner.execute_model``'s order replayed, each layer's compute stand-in
and TP's all-reduce of the hidden state (:class:`_RankStep`, the half of
:class:`~harness_pool.rank._Rank` that runs a step), and what each layer read (:class:`GDNRead`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch as _torch

from .model import _h40, draft_tokens, next_token, sample, state_value, true_hidden, true_output
from .runtime import _transfer_group, setup_runtime


@dataclass
class GDNRead:
    """What a layer found in a request's block when it read it (GDN state, or an attention block)."""

    instance: str
    rank: int
    step: int
    req_id: str
    layer: str
    kind: str  # "gdn" | "attn"
    block_index: int
    block_id: int
    expected: int  # tokens the content must cover
    actual: int | str  # tokens it covers, or "null" / "zero" / "other"

    @property
    def ok(self) -> bool:
        return self.actual == self.expected


class Draft(NamedTuple):
    """One proposal of the stand-in drafter: after the target sampled ``req_id``'s output token
    ``position`` (``tokens``: the sequence up to and with it) at ``step``; ``ok``: the MTP layer read
    right KV and the target's hidden state was right (on this rank)."""

    rank: int
    step: int
    req_id: str
    position: int
    tokens: tuple
    ok: bool

    def proposal(self, k: int) -> list[int]:
        return draft_tokens(self.tokens, k, self.ok)


def _accepted(seq, running: int, k: int) -> int:
    """How many of the ``k`` draft tokens after ``seq[:running]`` are the true continuation (the
    number a target computing from right inputs accepts)."""
    a = 0
    while a < k and seq[running + a] == next_token(seq[: running + a]):
        a += 1
    return a


class _GDNComputed(Exception):
    """Raised from the state read inside the original ``_forward_core``: the harness computed."""


class _RankStep:
    """The step half of one TP rank (:class:`~harness_pool.rank._Rank` builds its caches, layers and
    worker connector half): the layers' compute stand-ins, the hidden state, execute_model replayed."""

    # ------------------------------------------------------------------ compute stand-ins
    def gdn_compute(self, name: str) -> None:
        inst, so = self.inst, self.so
        layer = inst.layer_index[name]
        group = inst.group_of[name]
        tensors = list(list.__iter__(self.layers[name].kv_cache))  # [conv, temporal]
        key = self.rank_key(name)
        bs = inst.block_size
        outputs = {}
        for req_id in self.input_batch.req_ids:
            st = self.requests[req_id]
            seq, running, k = self.step_seq[req_id]
            done, n = st.num_computed_tokens, so.num_scheduled_tokens[req_id]
            ids = st.block_ids[group]
            # mamba_get_block_table_tensor (align): the block of the step's last token holds the
            # running state; a speculative step's draft slots are the blocks after it
            idx = (done + n - 1) // bs
            assert idx + k < len(ids), f"{req_id}: {k} draft slots after block {idx}, {len(ids)} blocks"
            # a speculative step starts from the state the last step accepted: the temporal state of
            # slot num_accepted - 1, the conv window at that row offset of the running block
            o = self.num_accepted.get(req_id, 1) - 1 if k else 0
            ok, raw = True, b""
            if done > 0:  # has_initial_state
                raw = self._block_bytes(tensors, ids[idx]) + self._block_bytes(tensors[1:], ids[idx + o])
                actual = self._decode_gdn(tensors, ids[idx], ids[idx + o], o, self._tokens(st), layer, key)
                inst.reads.append(GDNRead(inst.name, self.rank, inst.steps, req_id, name, "gdn", idx + o, ids[idx + o], done, actual))
                ok = actual == done
            outputs[req_id] = out = self._layer_output(req_id, seq[:running], layer, ok, raw)
            written = {ids[idx + j]: running + j for j in range(k + 1)}
            if 0 in written:  # vLLM's null block (BlockPool's first): shared by every request
                inst.null_writes.append((inst.steps, req_id, name))
            self._write_gdn(tensors, ids[idx], written, seq, running, layer, key, corrupt=out)
        self._all_reduce(layer, outputs)

    def attention(self, query, layer_name):
        if layer_name in self.inst.mtp_layers:
            if self.draft_pass == 0:  # later passes attend over the draft positions: no KV the pool keeps
                self._draft_read(self._attend(layer_name))
            return query
        self._all_reduce(self.inst.layer_index[layer_name], self._attend(layer_name))
        return query

    def _attend(self, layer_name) -> dict:
        """An attention layer's compute stand-in: reads every computed block of each request, writes
        this step's; this rank's output slice per request (None: the true one)."""
        inst = self.inst
        layer = inst.layer_index[layer_name]
        group = inst.group_of[layer_name]
        k, v = self.layers[layer_name].kv_cache
        key = self.rank_key(layer_name)
        bs = inst.block_size
        nbytes = k[0].numel() * k[0].element_size() * 2
        outputs = {}
        for req_id in self.input_batch.req_ids:
            st = self.requests[req_id]
            tokens = self._tokens(st)
            seq, running, drafts = self.step_seq[req_id]
            done = st.num_computed_tokens
            ok, raw = True, []
            for b in range(-(-done // bs)):
                block_id = st.block_ids[group][b]
                want = min((b + 1) * bs, done)
                raw.append(self._block_bytes((k, v), block_id))
                actual = self._decode(raw[-1], tokens, layer, key, block_id)
                inst.reads.append(GDNRead(inst.name, self.rank, inst.steps, req_id, layer_name, "attn", b, block_id, want, actual))
                ok = ok and actual == want
            # a block holds the KV of every position computed so far whose input the target keeps (a
            # rejected draft's slot is past the request's length: never read, rewritten later)
            end = running + _accepted(seq, running, drafts)
            outputs[req_id] = out = self._layer_output(req_id, seq[:running], layer, ok, b"".join(raw))
            for b in range(done // bs, -(-end // bs)):
                upto = min((b + 1) * bs, end)
                # the KV of this step's tokens is computed from the hidden state coming in
                value = state_value(seq[:upto], layer, key, nbytes) if out is None else state_value([*seq[:upto], -1, out], layer, key, nbytes)
                self._write_block((k, v), st.block_ids[group][b], value)
        return outputs

    def _draft_read(self, outputs: dict) -> None:
        """The MTP layer's first pass read (and wrote) its KV from the target's last hidden state: a
        request's proposal is right when every rank read right (a SUM of the wrong ones over the TP
        group when ranks are processes; the instance combines ranks in one process)."""
        reqs = self.input_batch.req_ids
        wrong = [int(outputs[r] is not None) for r in reqs]
        if self.group is not None:
            import torch.distributed as dist

            summed = _torch.tensor(wrong, dtype=_torch.int64)
            dist.all_reduce(summed, group=self.group)
            wrong = summed.tolist()
        self.draft_ok = {r: not w for r, w in zip(reqs, wrong)}

    # ------------------------------------------------------------------ the hidden state
    def _layer_output(self, req_id: str, tokens, layer: int, read_ok: bool, raw: bytes) -> int | None:
        """This rank's slice of the layer's output for ``req_id``: None when it is the true one (right
        bytes read, right hidden state coming in), else a hash of the hidden state and the bytes read."""
        if read_ok and self.clean[req_id]:
            return None
        return _h40("corrupt", layer, self.rank, self.hidden[req_id], raw)

    def _all_reduce(self, layer: int, outputs: dict) -> None:
        """TP's all-reduce of the layer's output slices: a SUM over the TP group's CPU (gloo) group
        when the ranks are processes; one rank's own slice otherwise (the instance sums the ranks'
        last hidden states when it samples, :meth:`PoolInstance._combine`)."""
        reqs = self.input_batch.req_ids
        ends = {r: self.step_seq[r][0][: self.step_seq[r][1]] for r in reqs}
        mine = [true_output(ends[r], layer, self.rank) if outputs[r] is None else outputs[r] for r in reqs]
        if self.group is None:
            for r, value in zip(reqs, mine):
                self.hidden[r], self.clean[r] = value, outputs[r] is None
            return
        import torch.distributed as dist

        summed = _torch.tensor(mine, dtype=_torch.int64)
        dist.all_reduce(summed, group=self.group)
        for r, value in zip(reqs, summed.tolist()):
            self.hidden[r], self.clean[r] = value, value == true_hidden(ends[r], layer, self.inst.tp)

    # ------------------------------------------------------------------ execute_model, replayed
    def _update_states(self, so) -> None:
        from vllm.v1.worker.gpu_input_batch import CachedRequestState

        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            for per_request in (self.num_accepted, self.next_drafts, self.prev_spec):
                per_request.pop(req_id, None)
        prev_spec, self.prev_spec = self.prev_spec, {}
        for new in so.scheduled_new_reqs:
            self.num_accepted.pop(new.req_id, None)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                mm_features=[],
                sampling_params=new.sampling_params,
                generator=None,
                block_ids=tuple(list(ids) for ids in new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                output_token_ids=[],
            )
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self.requests[req_id]
            st.num_computed_tokens = cached.num_computed_tokens[i]
            if self.inst.batch_queue_size and req_id in prev_spec and req_id not in cached.resumed_req_ids:
                # async scheduling scheduled this step before it saw the last one's output, counting
                # every draft token of it as computed: the runner takes the rejected ones back
                # (vLLM's deferred spec decode correction, from the counts it sampled)
                scheduled, accepted = prev_spec[req_id]
                st.num_computed_tokens -= scheduled - accepted
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.num_accepted.pop(req_id, None)
                st.block_ids = tuple(list(ids) for ids in new_ids)
                st.output_token_ids = list(st.output_token_ids[: cached.num_output_tokens[i]])
                continue
            if cached.num_output_tokens[i] < len(st.output_token_ids):
                # the scheduler discarded output tokens (a KV load failure rolled the request back):
                # the runner aligns its cached state, as vLLM's GPU runner does
                del st.output_token_ids[cached.num_output_tokens[i] :]
            if new_ids is not None:
                for ids, more in zip(st.block_ids, new_ids):
                    ids.extend(more)
        self.input_batch.req_ids = [r for r in so.num_scheduled_tokens if r in self.requests]
        for i, req_id in enumerate(self.input_batch.req_ids):
            self.input_batch.num_accepted_tokens_cpu[i] = self.num_accepted.get(req_id, 1)
        # each request's input this step: its tokens up to the running state, then the draft tokens
        # scheduled to verify (async scheduling's placeholders are this rank's own last proposals)
        self.step_seq = {}
        for req_id in self.input_batch.req_ids:
            st = self.requests[req_id]
            drafts = list(so.scheduled_spec_decode_tokens.get(req_id, ()))
            if any(t < 0 for t in drafts):
                own = self.next_drafts.get(req_id, [])
                drafts = [own[j] if j < len(own) else 0 for j in range(len(drafts))]
            running = st.num_computed_tokens + so.num_scheduled_tokens[req_id] - len(drafts)
            tokens = self._tokens(st)
            assert running <= len(tokens), f"{req_id}: runs to {running} tokens, has {len(tokens)}"
            self.step_seq[req_id] = (tokens[:running] + drafts, running, len(drafts))

    def execute(self, so):
        rt = setup_runtime()
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
        from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

        self.so = so
        with _transfer_group(self.connector):
            if self.connector is not None:
                self.connector.handle_preemptions(so.kv_connector_metadata)
            self._update_states(so)
            # every request enters the first layer with the true embedding of its tokens
            self.hidden = dict.fromkeys(self.input_batch.req_ids, 0)
            self.clean = dict.fromkeys(self.input_batch.req_ids, True)
            if not so.total_num_scheduled_tokens:
                if self.connector is None:
                    return EMPTY_MODEL_RUNNER_OUTPUT
                return rt.runner.kv_connector_no_forward(so, self.config)
            bufs = self.mamba_bufs.preprocess
            rt.runner_module.mamba_utils.preprocess_mamba(
                so,
                self.kv_cache_config,
                self.config.cache_config,
                self.mamba_state_idx,
                self.input_batch,
                self.requests,
                self.config.compilation_config.static_forward_context,
                self.inst.copy_funcs,
                bufs,
            )
            for i, req_id in enumerate(self.input_batch.req_ids):  # a boundary copy resets it to 1
                self.num_accepted[req_id] = int(self.input_batch.num_accepted_tokens_cpu[i])
            metadata = {name: GDNAttentionMetadata(1, 1, 0, 0, 0, 0, 1) for name in self.inst.gdn_layers}
            metadata.update({name: object() for name in [*self.inst.attn_layers, *self.inst.mtp_layers]})
            defer = self.config.speculative_config is not None
            with (
                set_forward_context(metadata, self.config, slot_mapping={}),
                rt.runner.maybe_get_kv_connector_output(so, defer_finalize=defer) as kv_output,
            ):
                # vllm-ascend 0.30's runner: a connector with prepare_mamba_state_copy stages the copy per
                # layer (after each layer's load) and is told finish_mamba_state_copy after the forward
                staged = getattr(self.connector, "prepare_mamba_state_copy", None)
                staged = self.connector if callable(staged) and staged(bufs) else None
                if staged is None:
                    rt.runner_module.mamba_utils.do_mamba_copy_block(bufs)
                self._forward()
                if staged is not None:
                    staged.finish_mamba_state_copy()
            out_tokens = self._sample()
            if defer:  # the runner's sample_tokens: the mamba postprocess, the drafter, the deferred finalize
                self._postprocess(out_tokens)
                self.draft_ok = {}
                if self._input_fits_in_drafter(so):
                    with set_forward_context(metadata, self.config, slot_mapping={}):
                        self._draft()
                rt.runner.finalize_kv_connector()
        return ModelRunnerOutput(
            req_ids=list(self.input_batch.req_ids),
            req_id_to_index={r: i for i, r in enumerate(self.input_batch.req_ids)},
            sampled_token_ids=out_tokens,
            kv_connector_output=kv_output,
        )

    def _sample(self) -> list[list[int]]:
        """The tokens sampled for each request of the batch (none for a prefill chunk short of the
        prompt's end). A speculative step is verified as vLLM's rejection sampler does at
        temperature 0: the draft tokens the target agrees with, then the target's own token; from
        a wrong hidden state, one token of no clean sequence."""
        out = []
        for req_id in self.input_batch.req_ids:
            seq, running, k = self.step_seq[req_id]
            hidden, clean = self.hidden[req_id], self.clean[req_id]
            if running < len(self._tokens(self.requests[req_id])):
                out.append([])
            elif k and clean:
                a = _accepted(seq, running, k)
                out.append([*seq[running : running + a], sample(seq[: running + a], hidden, True)])
            else:
                out.append([sample(seq[:running], hidden, clean)])
        return out

    def _postprocess(self, out_tokens) -> None:
        """vLLM's align-mode mamba postprocess after a speculative step (the runner's
        ``postprocess_mamba_align_gpu``, the fused kernel the library swaps; here its decisions
        and copies in torch on this rank's strided state views, as ``tests/interp`` checks the kernel
        does them): each request's accepted-token count, and where the accepted tokens crossed a
        block boundary the state at that boundary copied into the block it ends (the conv window
        shifted by the accepted draft count, the temporal state of that draft's slot)."""
        reqs = self.input_batch.req_ids
        bs = self.inst.block_size
        for i, req_id in enumerate(reqs):
            seq, running, k = self.step_seq[req_id]
            accepted = len(out_tokens[i]) if k and out_tokens[i] else 1
            if k and out_tokens[i]:
                self.prev_spec[req_id] = (k, accepted - 1)
            new_computed = running + accepted - 1
            boundary = new_computed // bs * bs
            src = self.mamba_state_idx[req_id]
            if boundary >= running:
                bias, dest = boundary - running, boundary // bs - 1
                if src == dest:
                    accepted = 1
                if src != dest or bias:
                    self._copy_state(req_id, src, dest, bias)
            self.num_accepted[req_id] = accepted

    def _copy_state(self, req_id: str, src: int, dest: int, bias: int) -> None:
        """One request's mamba state copy, every GDN layer: block ``src``'s conv rows from ``bias``
        on to the top of block ``dest``, block ``src + bias``'s temporal state to block ``dest``."""
        st = self.requests[req_id]
        for name in self.inst.gdn_layers:
            ids = st.block_ids[self.inst.group_of[name]]
            conv, ssm = list.__iter__(self.layers[name].kv_cache)
            rows = conv[ids[src], bias:].clone()
            conv[ids[dest], : rows.shape[0]] = rows
            ssm[ids[dest]] = ssm[ids[src + bias]].clone()

    def accept(self, output) -> None:
        """The runner keeps the tokens sampled this step (the same on every rank); under MTP the
        drafter proposes after each (:class:`Draft`, in ``inst.drafts``), or, where it did not run,
        zeros (vLLM's runners: no stale drafts are scheduled)."""
        for req_id, toks in zip(output.req_ids, output.sampled_token_ids):
            if toks and req_id in self.requests:
                st = self.requests[req_id]
                if self.inst.mtp:
                    self.next_drafts[req_id] = [0] * self.inst.mtp
                if self.inst.mtp and req_id in self.draft_ok:
                    seq = (*self._tokens(st), *toks)
                    draft = Draft(self.rank, self.inst.steps, req_id, len(st.output_token_ids) + len(toks) - 1, seq, self.draft_ok[req_id])
                    self.inst.drafts.append(draft)
                    self.next_drafts[req_id] = draft.proposal(self.inst.mtp)
                st.output_token_ids.extend(toks)

    def _forward(self) -> None:
        rt = setup_runtime()
        self.in_forward = True
        try:
            for name in self.inst.layer_order:
                if name in self.inst.gdn_layers:
                    t = _torch.zeros(1, 1)
                    try:
                        self.layers[name]._forward_core(t, t, t, t)
                    except _GDNComputed:
                        pass
                    else:
                        raise AssertionError(f"{name}: _forward_core returned without reading its state")
                    rt.gdn.maybe_save_kv_layer_to_connector("", [])  # the original's own last line
                else:
                    self.inst.attention_op(_torch.zeros(1), name)
        finally:
            self.in_forward = False

    def _input_fits_in_drafter(self, so) -> bool:
        """The runners' rule for drafting a step at all (vllm-ascend 0.30's ``_input_fits_in_drafter``,
        vLLM's ``input_fits_in_drafter``): the longest sequence of the batch plus the draft tokens
        fits the model length; else no MTP layer runs that step."""
        longest = max(self.requests[r].num_computed_tokens + so.num_scheduled_tokens[r] for r in self.input_batch.req_ids)
        return longest + self.inst.mtp <= self.inst.max_model_len

    def _draft(self) -> None:
        """The stand-in drafter (MTP), after the target's forward, with the connector's metadata still
        bound (``defer_finalize``, as vLLM's runners draft after sampling): the MTP layer runs once per
        draft token; its first pass reads and writes the KV of the step's tokens (:meth:`attention`);
        the proposal is formed with the sampled token (:meth:`accept`)."""
        # a draft replayed as a captured graph (``draft_graph``) runs the layer's compute only: no
        # Python wrapper, so no connector hook (vLLM's maybe_transfer_kv_layer) around it
        op = self.attention if self.inst.draft_graph else self.inst.attention_op
        for self.draft_pass in range(self.inst.mtp):
            for name in self.inst.mtp_layers:
                op(_torch.zeros(1), name)
        self.draft_pass = 0
