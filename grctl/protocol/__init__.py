"""The HTTP contract of docs/http-api.md as msgspec Structs, shared by the server and the client.

`*Body` is what a route reads; `*Response` (and its nested parts) what it answers. Every reply
field has a default, so the client reads grctl's replies and SGLang's (which lack grctl's extra
keys) with the same Struct, and the server builds the same Struct with every field given. Where
the server leaves absent keys out, as SGLang does, it sends a `Strict*` subclass: the keys it
always sends are required there, the optional ones omitted when unset.

Request bodies ignore unknown keys (msgspec's default); the server converts them with
strict=False, so "3" is read as 3 where an int is expected. Modules here import nothing of grctl
but errors, and have no `from __future__ import annotations`: msgspec and Litestar read these
annotations at runtime.
"""
