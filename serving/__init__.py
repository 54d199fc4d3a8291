"""kvfleet's OpenAI-compatible HTTP API: a Ray Serve application over the cluster.

``serving.app:build_app`` is the import path for ``serve run`` and a RayService;
``serving.launch`` starts it on an embedded Ray for ``kvfleet serve``; ``serving.api.build_api``
is the FastAPI application itself.
"""
