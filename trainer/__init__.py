"""The publishing side's trainer: online training of a DLRM (or a user's model) on a stream.

Batches are scored before they are trained on (progressive validation); at every interval
boundary `IncrementalCheckpointer` copies the rows modified since the last checkpoint and hands
them to a background publisher that quantizes, commits and announces them.
"""
