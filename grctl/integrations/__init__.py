"""Adapters that let a trainer's own rollout code drive running grctl servers over HTTP.

Each imports only grctl's client and protocol (never the server or the engine), and its trainer
lazily: importing this package needs none of them.
"""
