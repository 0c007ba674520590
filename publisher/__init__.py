"""The publishing side: codecs, tracking, policies, stores, the commit protocol, restore."""
