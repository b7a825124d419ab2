"""Bans repeating either of the sequence's last two tokens."""
from decodekit import hookimpl


@hookimpl
def decodekit_config_fields():
    return {"ban_recent": False}


@hookimpl
def decodekit_logits_processors(generation_config):
    if not generation_config.ban_recent:
        return []

    def ban(input_ids, scores):
        scores[:, input_ids[0, -2:]] = -float("inf")
        return scores

    return [ban]
