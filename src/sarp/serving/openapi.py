"""The OpenAPI 3.1 document of ``sarp serve --http`` (served at ``GET /openapi.json``):
every endpoint, its body and its answers, as :mod:`sarp.serving.http` and
:mod:`sarp.serving.rfc` serve them.  ``tests/test_client.py`` validates it and checks
real answers against its schemas.

>>> sorted(document("0.1.0")["paths"])[:3]
['/healthz', '/metrics', '/openapi.json']
"""

from __future__ import annotations

_INT_ARRAY = {"type": "array", "items": {"type": "integer"}}
_ERROR = {"type": "object", "required": ["error"],
          "properties": {"error": {"type": "string", "description": "what is wrong, and the fix"},
                         "field": {"type": "string", "description": "the field at fault"}}}


def _json(schema: dict, text: str) -> dict:
    return {"description": text, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict:
    texts = {400: "bad input: the field and the fix", 401: "no or wrong bearer token",
             404: "no engine registered with that model (and group), or instance unknown",
             409: "the registration conflicts with one followed", 413: "too large",
             503: "the index or the writer cannot answer now; try again"}
    return {str(c): _json({"$ref": "#/components/schemas/Error"}, texts[c]) for c in codes}


_INSTANCE = {"type": "object", "required": ["instance", "engine", "matched_blocks", "score"],
             "properties": {"instance": {"type": "string", "description": "holder: NAME#rank"},
                            "engine": {"type": "string"},
                            "dp_rank": {"type": ["integer", "null"]},
                            "matched_blocks": {"type": "integer"},
                            "matched_tokens": {"type": ["integer", "null"]},
                            "by_medium": {"type": "object",
                                          "additionalProperties": {"type": "integer"}},
                            "score": {"type": "number"}}}
_MATCH = {"type": "object", "required": ["matched_blocks", "instances"],
          "properties": {"matched_blocks": {"type": "integer"},
                         "instances": {"type": "array",
                                       "items": {"$ref": "#/components/schemas/Instance"}}}}
_MATCH_REQUEST = {
    "type": "object", "additionalProperties": False,
    "description": "exactly one of block_hashes, token_ids and requests",
    "properties": {
        "block_hashes": {**_INT_ARRAY, "description": "the request's chain (uint64 or int64)"},
        "token_ids": {**_INT_ARRAY, "description": "hashed in serve's --hash-scheme"},
        "requests": {"type": "array", "items": _INT_ARRAY,
                     "description": "many chains at once (a scheduler step)"},
        "block_size": {"type": "integer", "minimum": 1},
        "weights": {"type": "object", "additionalProperties": {"type": "number", "minimum": 0},
                    "description": "score weight per medium, e.g. {\"GPU\": 1.0}"}}}
_QUERY_REQUEST = {
    "type": "object", "required": ["model_name"],
    "properties": {"model_name": {"type": "string"},
                   "routing_group": {"type": "string", "default": "default"},
                   "tenant_id": {"type": "string", "description": "routing_group's other name"},
                   "lora_name": {"type": "string"},
                   "token_ids": _INT_ARRAY,
                   "block_hashes": {**_INT_ARRAY, "description": "RFC #1403 per-block hashes"}}}
_QUERY = {
    "type": "object", "required": ["scores", "frequencies", "instances"],
    "properties": {
        "scores": {"type": "object", "description": "instance -> DP rank -> GPU tokens",
                   "additionalProperties": {"type": "object",
                                            "additionalProperties": {"type": "integer"}}},
        "frequencies": {"type": "array"},
        "instances": {"type": "object", "additionalProperties": {
            "type": "object",
            "properties": {"longest_matched": {"type": "integer"}, "gpu": {"type": "integer"},
                           "cpu": {"type": "integer"}, "disk": {"type": "integer"},
                           "dp": {"type": "object",
                                  "additionalProperties": {"type": "integer"}}}}}}}
_REGISTER = {
    "type": "object", "required": ["instance_id", "endpoint"],
    "properties": {"instance_id": {"type": ["integer", "string"]},
                   "endpoint": {"type": "string", "description": "the engine's ZeroMQ PUB"},
                   "replay_endpoint": {"type": "string"},
                   "dp_rank": {"type": "integer", "minimum": 0, "maximum": 4095},
                   "model_name": {"type": "string"},
                   "block_size": {"type": "integer", "minimum": 1, "maximum": 65535},
                   "routing_group": {"type": "string"}, "tenant_id": {"type": "string"}}}
_UNREGISTER = {"type": "object", "required": ["instance_id"],
               "properties": {k: _REGISTER["properties"][k]
                              for k in ("instance_id", "dp_rank", "model_name")}}
_OK = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
_READY = {"type": "object", "required": ["ready"],
          "properties": {"ready": {"type": "boolean"}, "caught_up": {"type": "boolean"},
                         "writer_heartbeat_fresh": {"type": "boolean"},
                         "hash_mismatches": {"type": "object"}}}


def _post(summary: str, request: dict, answer: dict, *errors: int, ok: str = "200") -> dict:
    return {"post": {"summary": summary,
                     "requestBody": {"required": True,
                                     "content": {"application/json": {"schema": request}}},
                     "responses": {ok: _json(answer, "the answer"), **_errors(*errors)}}}


def _get(summary: str, answer: dict, *errors: int, kind: str = "application/json") -> dict:
    body = {"description": "the answer", "content": {kind: {"schema": answer}}}
    return {"get": {"summary": summary, "responses": {"200": body, **_errors(*errors)}}}


def document(version: str) -> dict:
    """The OpenAPI document for sarp ``version``.  Cost: builds a small dict."""
    ref = {"$ref": "#/components/schemas/Match"}
    return {
        "openapi": "3.1.0",
        "info": {"title": "sarp serve", "version": version,
                 "description": "An on-SSD KV-cache prefix index as a service: which "
                                "engine instances hold how much of a request's prefix. "
                                "Every endpoint but /healthz and /readyz asks for the "
                                "bearer token of --http-token-file, when serve has one."},
        "components": {"schemas": {"Error": _ERROR, "Instance": _INSTANCE, "Match": _MATCH},
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}, {}],
        "paths": {
            "/v1/match": _post("the cached prefix of a request (or of many) per instance",
                               _MATCH_REQUEST, {"oneOf": [ref, {
                                   "type": "object", "required": ["results"],
                                   "properties": {"results": {"type": "array",
                                                              "items": ref}}}]},
                               400, 401, 413, 503),
            "/query": _post("RFC #1403: the cached prefix of a request's tokens, in tokens "
                            "per instance, DP rank and tier", _QUERY_REQUEST, _QUERY,
                            400, 401, 404, 413, 503),
            "/query_by_hash": _post("RFC #1403: the same for the request's per-block hashes",
                                    _QUERY_REQUEST, _QUERY, 400, 401, 404, 413, 503),
            "/register": _post("follow an engine's KV events (RFC #1403, as Dynamo's "
                               "indexer)", _REGISTER, _OK, 400, 401, 409, 503, ok="201"),
            "/unregister": _post("stop following an engine; its blocks are cleared",
                                 _UNREGISTER, _OK, 400, 401, 404, 503),
            "/workers": _get("the engines followed", {"type": "array", "items": {
                "type": "object", "required": ["instance_id", "endpoints"],
                "properties": {"instance_id": {"type": ["integer", "string"]},
                               "model_name": {"type": ["string", "null"]},
                               "block_size": {"type": ["integer", "null"]},
                               "endpoints": {"type": "object"}}}}, 401),
            "/healthz": _get("this worker is alive", {
                "type": "object", "required": ["status"],
                "properties": {"status": {"const": "alive"}, "pid": {"type": "integer"}}}),
            "/readyz": {"get": {"summary": "every engine caught up since start, and the "
                                           "writer's heartbeat fresh",
                                "responses": {"200": _json(_READY, "ready"),
                                              "503": _json(_READY, "not ready")}}},
            "/metrics": _get("Prometheus text (docs/operating.md lists the metrics)",
                             {"type": "string"}, 401, kind="text/plain"),
            "/openapi.json": _get("this document", {"type": "object"}, 401),
        },
    }
