"""sglang-router's worker registry: the routes a replica joins and leaves it by (server/router.py)
and a fleet push reads it by (client/router.py).

SGLang's Rust gateway (`pip install grctl[router]`, `python -m sglang_router.launch_router`)
keeps the list of workers it balances /generate over:
    GET    /workers              {"workers": [{"id", "url", "is_healthy", ...}], "total", ...}
    POST   /workers              {"url", "api_key"?} -> 202 {"worker_id", ...}; it then probes
                                 the worker (/health, /get_server_info, /get_model_info)
    DELETE /workers/{worker_id}  -> 202
Older routers (before 0.2) had GET /list_workers {"urls"}, POST /add_worker?url= and POST
/remove_worker?url=; each call falls back to those when the new route answers 404.
"""

WORKERS = "/workers"
OLD_LIST_WORKERS = "/list_workers"
OLD_ADD_WORKER = "/add_worker"
OLD_REMOVE_WORKER = "/remove_worker"
TIMEOUT_S = 10.0  # every registry call
