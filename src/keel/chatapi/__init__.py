"""OpenAI's chat and text completions API as Keel speaks it: the request models and their checks
(`schema.py`), errors in OpenAI's shape (`errors.py`), answers, bodies and stream chunks
(`responses.py`), tools in chat requests (`chat_tools.py`). `keel serve` (keel.serve) and the
training-time gateway (keel.envs.gateway) answer through them."""
