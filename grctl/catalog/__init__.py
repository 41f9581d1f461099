"""The item catalog: JSONL item paths, the token trie built from them, and the versioned store."""
