"""kvfleet's entry points: the ``kvfleet`` CLI (``kvfleet.cli``) and the ``ray job submit`` /
KubeRay RayJob entry point (``python -m kvfleet.job``). They sit above both the driver API
(``cluster``) and the HTTP API (``serving``), so neither of those imports the other's launcher."""
