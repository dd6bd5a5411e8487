"""The suite's stand-ins for what the real rollout chain runs on remotely: an HF Sandbox (bubblewrap + overlayfs over
a local image root), OpenCode preinstalled in that image, the task data bucket (loopback HTTP)."""
