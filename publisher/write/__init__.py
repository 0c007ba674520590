"""The write side: dirty-row tracking, policies, snapshots, encoding and the commit."""
