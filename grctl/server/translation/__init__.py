"""Request translation: wire bodies (SGLang's /generate, OpenAI's) -> engine requests, engine
results -> replies. The infrastructure beside it (app, guards, limits, offload) parses no body."""
