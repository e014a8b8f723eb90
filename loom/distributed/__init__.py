"""Loom on Ray Serve: engine replicas on any node behind one OpenAI endpoint (`loom serve --replicas N`).

Ray is an optional extra (`pip install "loom[ray]"`); nothing outside this package imports it.
"""
