"""The jit-compiled phase programs (reference scoring, actor update) and their host-side inputs."""
