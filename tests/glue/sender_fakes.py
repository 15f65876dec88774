"""A stand-in for pb_utils' InferenceResponseSender that records what a model sends."""
from __future__ import annotations


class RecordingSender:
    def __init__(self):
        self.sent = []   # (response, flags) in send order

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))

    def is_cancelled(self):
        return False
