"""The read side: the version catalog, restore, following announcements, retention."""
