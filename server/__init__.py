"""The serving side: a live model that follows committed versions and answers predictions.

    checknrun serve --store s3://bucket/prefix --bus kafka://host:9092/versions --model movielens

`server.app.create_app(settings)` builds the FastAPI application; its lifespan opens the store and
the announcement source, bootstraps the model from HEAD and follows new versions in a background
thread (`server.follow_loop.FollowLoop`). `server.live_model.LiveModel` is the version-consistent
model every prediction reads. The server stands on the publisher's read side (store, catalog,
restore, bus, follower) and on `schemas/`; nothing imports it.
"""
