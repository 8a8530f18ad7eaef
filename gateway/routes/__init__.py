"""HTTP routers: each a few lines that hand a parsed request to ``gateway.api.serving`` or the backend;
``gateway.app`` mounts them."""
