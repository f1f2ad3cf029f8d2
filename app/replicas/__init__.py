"""Scale-out on Ray Serve: N engine replicas behind one OpenAI + DJL endpoint.

`seqgate serve --replicas N` keeps the HTTP side in the seqgate process (the same Litestar app,
the same uvicorn, the same drain) and swaps the in-process engine for `RemoteEngine`, which
sends each job to a Ray Serve deployment of engine replicas (`EngineReplica`) through a
deployment handle. Which replica takes a job is decided by Ray Serve's request router, with our
router class (`SeqgateRouter`): prefix-cache affinity balanced by load, least-loaded, or
round-robin (`policy.py` holds the decision, free of Ray).

Only `policy.py` is importable without the `seqgate[ray]` extra; the others import ray.
"""
