"""Several engines behind one client: generation through a router, control calls to every engine.
Used by the trainer and the rollout producer when `engine.urls` lists more than one engine; build one
with `make_engine(cfg.engine)`. Test: `pytest tests/test_engine_group.py`.

`sglang-router` balances /generate only; pause, continue, flush and weight updates must reach each
engine directly (docs/sglang-contract.md §5). Every control call here goes to all engines in
parallel and counts as done only when all of them answered; if any failed, the first failure is
raised after the others finished, so no engine is left mid-call behind the caller's back.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from nano_miles.engine.client import EngineClient, EngineError, parse_version

REQUEST_THREADS = 256  # generation requests in flight through the router at once (an engine batches them)


class EngineGroup:
    def __init__(self, urls: list[str], *, router_url: str = "", timeout_s: float = 600.0):
        assert urls, "an engine group needs at least one engine"
        self.engines = [EngineClient(u, timeout_s=timeout_s) for u in urls]
        self.router = EngineClient(router_url or urls[0], timeout_s=timeout_s)
        self.base_url = self.router.base_url
        self._pool = ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="engine-fanout")
        self._requests = ThreadPoolExecutor(max_workers=REQUEST_THREADS, thread_name_prefix="router-requests")

    def on_all(self, method: str, *args, **kwargs) -> list:
        """`EngineClient.<method>(*args)` on every engine at once; every answer, in `urls` order."""
        futures = [self._pool.submit(getattr(e, method), *args, **kwargs) for e in self.engines]
        results, errors = [], []
        for f in futures:
            try:
                results.append(f.result())
            except (EngineError, OSError) as e:
                errors.append(e)
        if errors:
            raise errors[0]
        return results

    # ---- generation: through the router
    def generate(self, input_ids, sampling_params, **kwargs):
        """Like `EngineClient.generate`, through the router, which takes one sampling map per request.

        A batch whose maps differ only in `sampling_seed` (a fresh group) goes as one request with
        the seeds left out: one engine generates the whole group, as it would without a router, and
        its samples draw from the engine's generator (one seed in a shared map would give them all
        the same draws). Other batches (samples resumed with different budgets) go as one request
        per sample, all at once. Per-group requests matter on a GPU: SGLang's cost is per request,
        and one per sample made generation through the router slower than one engine alone."""
        if not isinstance(sampling_params, list):
            return self.router.generate(input_ids, sampling_params, **kwargs)
        unseeded = [{k: v for k, v in params.items() if k != "sampling_seed"} for params in sampling_params]
        if all(params == unseeded[0] for params in unseeded):
            return self.router.generate(input_ids, unseeded[0], **kwargs)
        futures = [self._requests.submit(self.router.generate, ids, params, **kwargs)
                   for ids, params in zip(input_ids, sampling_params, strict=True)]
        return [f.result() for f in futures]

    def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        return self.router.score(prompt_ids, response_ids)

    # ---- health and state: every engine
    def health(self, timeout_s: float = 5.0) -> bool:
        return all(self.on_all("health", timeout_s))

    def wait_until_healthy(self, timeout_s: float, poll_s: float = 0.5) -> None:
        self.on_all("wait_until_healthy", timeout_s, poll_s)

    def model_info(self) -> dict:
        """The first engine's info; `weight_version` is the common one, or None if engines disagree
        (a restarted engine serves base weights: the trainer then pushes to all of them again)."""
        infos = self.on_all("model_info")
        versions = {info.get("weight_version") for info in infos}
        return {**infos[0], "weight_version": versions.pop() if len(versions) == 1 else None}

    def weight_version(self) -> int | None:
        """The version every engine serves; None while they disagree (one restarted with base weights)."""
        return parse_version(self.model_info()["weight_version"])

    def server_info(self) -> dict:
        """The first engine's info, with every engine's internal state (busy time summed)."""
        infos = self.on_all("server_info")
        states = [s for info in infos for s in (info.get("internal_states") or [{}])]
        busy = [s.get("busy_s") for s in states]
        merged = {"busy_s": sum(busy)} if all(b is not None for b in busy) else {}
        return {**infos[0], "internal_states": [merged, *states]}

    # ---- control: every engine, in parallel
    def pause(self, mode: str = "abort") -> list[dict]:
        return self.on_all("pause", mode)

    def resume(self) -> list[dict]:
        return self.on_all("resume")

    def flush_cache(self) -> list:
        return self.on_all("flush_cache")

    def begin_weight_update(self) -> list[dict]:
        return self.on_all("begin_weight_update")

    def end_weight_update(self) -> list[dict]:
        return self.on_all("end_weight_update")

    def update_weights_from_tensor(self, serialized: list[str], **kwargs) -> list[dict]:
        return self.on_all("update_weights_from_tensor", serialized, **kwargs)

    def update_weights_from_disk(self, model_path: str, **kwargs) -> list[dict]:
        return self.on_all("update_weights_from_disk", model_path, **kwargs)


def make_engine(engine_cfg, timeout_s: float | None = None) -> EngineClient | EngineGroup:
    """A plain client for one engine without a router; a group otherwise (`engine.replicas` or `urls`).
    Requests time out after `timeout_s` (default: `engine.request_timeout_s`)."""
    urls, router_url = engine_cfg.engine_urls, engine_cfg.generation_url
    timeout_s = engine_cfg.request_timeout_s if timeout_s is None else timeout_s
    if len(urls) == 1 and not router_url:
        return EngineClient(urls[0], timeout_s=timeout_s)
    return EngineGroup(urls, router_url=router_url, timeout_s=timeout_s)
