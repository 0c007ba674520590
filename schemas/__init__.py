"""Contracts shared by the publishing and the serving side: manifest, announcement, delta blob.

Nothing here knows about torch, storage or transport: these modules turn bytes into validated
values and back. The rules are written down in docs/FORMAT.md.
"""
