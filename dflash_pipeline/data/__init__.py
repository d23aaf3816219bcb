"""Data handling: prompt rows, sharding, tokenized rows. Depends only on storage."""
