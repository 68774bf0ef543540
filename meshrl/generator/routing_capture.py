"""Routed experts per request from vLLM's V1 model runner, which does not return them.

vLLM 0.32 returns a request's routed experts (`enable_return_routed_experts`) only from its
model runner V2, which needs Triton on a GPU; the CPU backend runs the V1 runner and refuses
the option. The routers still call vLLM's own capture hook (`bind_routed_experts_capturer`:
`capture(layer_id, topk_ids)` after every MoE layer's top-k), so the worker can record the
ids itself and file them by request:

- before each forward, the runner's `_prepare_inputs` is wrapped to note the step's layout:
  the requests in batch order, the tokens scheduled for each, and each one's first position
  (its computed tokens) and prompt length;
- the capture hook writes the step's ids into one [tokens, layers, K] buffer (-1 where a
  layer is dense, as `meshrl.trainer.routing` reads it);
- after the forward, `execute_model`'s wrapper files the rows of every position from the
  prompt's last one on (the forwards that produced sampled tokens; prefill rows are not
  trained on) under the request. A recomputed position (preemption) overwrites its row.

`take(request, n)` hands over and forgets a request's rows for its n sampled tokens. Rows of
requests nobody takes (aborted, or an engine asked for none) are dropped once the request has
finished and `keep_finished` newer ones have finished after it.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch


class RoutingCapture:
    """Installed on one vLLM V1 worker by `install`; see the module docstring."""

    def __init__(self, num_layers: int, top_k: int, max_tokens: int, keep_finished: int = 1024):
        self.step = torch.full((max_tokens, num_layers, top_k), -1, dtype=torch.int16)
        self.written = 0  # rows of `step` the last forward wrote
        self.plan: tuple | None = None
        self.rows: dict[str, dict[int, torch.Tensor]] = {}  # worker request id -> {position: [L, K]}
        self.prompt_len: dict[str, int] = {}
        self.finished: OrderedDict[str, None] = OrderedDict()
        self.keep_finished = keep_finished

    @classmethod
    def install(cls, runner) -> "RoutingCapture":
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

        model_config = runner.vllm_config.model_config
        capture = cls(
            model_config.get_total_num_hidden_layers(), model_config.get_num_experts_per_tok(), runner.vllm_config.scheduler_config.max_num_batched_tokens
        )
        bind_routed_experts_capturer(runner.get_model(), capture)
        prepare_inputs, execute_model = runner._prepare_inputs, runner.execute_model

        def _prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs):
            batch, n = runner.input_batch, runner.input_batch.num_reqs
            capture.plan = (
                list(batch.req_ids[:n]),
                np.array(num_scheduled_tokens[:n]),
                batch.num_computed_tokens_cpu[:n].copy(),
                batch.num_prompt_tokens[:n].copy(),
            )
            return prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs)

        def _execute_model(scheduler_output, *args, **kwargs):
            capture.begin()
            try:
                return execute_model(scheduler_output, *args, **kwargs)
            finally:
                capture.commit()
                capture.forget(scheduler_output.finished_req_ids)

        runner._prepare_inputs, runner.execute_model = _prepare_inputs, _execute_model
        return capture

    # ---- one engine step ------------------------------------------------------------------
    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        n = topk_ids.shape[0]
        self.step[:n, layer_id] = topk_ids
        self.written = max(self.written, n)

    def begin(self) -> None:
        self.step[: self.written] = -1
        self.written = 0
        self.plan = None

    def commit(self) -> None:
        if self.plan is None or self.written == 0:
            return
        req_ids, scheduled, computed, prompt_lens = self.plan
        start = 0
        for req_id, n, first, prompt_len in zip(req_ids, scheduled.tolist(), computed.tolist(), prompt_lens.tolist()):
            skip = max(0, prompt_len - 1 - first)  # positions before the prompt's last one
            if skip < n:
                rows = self.rows.setdefault(req_id, {})
                self.prompt_len[req_id] = prompt_len
                block = self.step[start + skip : start + n].clone()
                for i in range(n - skip):
                    rows[first + skip + i] = block[i]
            start += n

    def forget(self, finished_req_ids) -> None:
        for req_id in finished_req_ids:
            self.finished[req_id] = None
        while len(self.finished) > self.keep_finished:
            req_id, _ = self.finished.popitem(last=False)
            self.rows.pop(req_id, None)
            self.prompt_len.pop(req_id, None)

    # ---- hand-over ------------------------------------------------------------------------
    def take(self, request_id: str, n: int) -> torch.Tensor | None:
        """[n, L, K] int16 ids of the forwards that produced the n sampled tokens of the
        request (vLLM's own id, or the caller's: vLLM appends `-` and a random suffix), -1
        for any not captured; None if the worker saw no such request."""
        worker_id = request_id if request_id in self.rows else self._worker_id(request_id)
        if worker_id is None:
            return None
        rows, prompt_len = self.rows.pop(worker_id), self.prompt_len.pop(worker_id)
        self.finished.pop(worker_id, None)
        out = torch.full((n, *self.step.shape[1:]), -1, dtype=torch.int16)
        for position, row in rows.items():
            i = position - (prompt_len - 1)
            if 0 <= i < n:
                out[i] = row
        return out

    def _worker_id(self, request_id: str) -> str | None:
        found = [key for key in self.rows if key.rpartition("-")[0] == request_id]
        return found[-1] if found else None
