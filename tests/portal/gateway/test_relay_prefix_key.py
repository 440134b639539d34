"""The prompt-start key the relay routes base-model requests by (portal.gateway.relay.
prompt_prefix_key): every turn of one conversation, and every conversation sharing one system
prompt within a tenant, gets the same key; other prompts and other tenants get other keys; a
prompt the key cannot read routes by the model alone."""

from __future__ import annotations

from portal.gateway.relay import PREFIX_KEY_CHARS, prompt_prefix_key

SYSTEM = {"role": "system", "content": "You are the support bot of Acme. Answer briefly."}


def chat(*messages, salt="tenant-1"):
    return {"messages": list(messages), "cache_salt": salt}


def test_every_turn_of_a_conversation_and_every_chat_on_one_system_prompt_share_a_key():
    first_turn = chat(SYSTEM, {"role": "user", "content": "Where is my order?"})
    third_turn = chat(SYSTEM, {"role": "user", "content": "Where is my order?"},
                      {"role": "assistant", "content": "On its way."}, {"role": "user", "content": "When?"})
    other_user = chat(SYSTEM, {"role": "user", "content": "Refund, please."})

    key = prompt_prefix_key(first_turn)
    assert key is not None and len(key) == 32
    assert prompt_prefix_key(third_turn) == prompt_prefix_key(other_user) == key


def test_other_system_prompts_and_other_tenants_get_other_keys():
    base = prompt_prefix_key(chat(SYSTEM))
    assert prompt_prefix_key(chat({"role": "system", "content": "You are a pirate."})) != base
    assert prompt_prefix_key(chat(SYSTEM, salt="tenant-2")) != base  # their KV is never shared anyway
    assert prompt_prefix_key(chat({"role": "user", "content": SYSTEM["content"]})) != base


def test_content_parts_and_completion_prompts_have_keys_too():
    parts = chat({"role": "system", "content": [{"type": "text", "text": "You are"}, {"type": "text", "text": "x"}]})
    assert prompt_prefix_key(parts) == prompt_prefix_key(chat({"role": "system", "content": "You are\nx"}))
    long = "Once upon a time " * 1000
    assert prompt_prefix_key({"prompt": long}) == prompt_prefix_key({"prompt": long[:PREFIX_KEY_CHARS] + "else"})
    assert prompt_prefix_key({"prompt": [long, "other"]}) == prompt_prefix_key({"prompt": long})


def test_what_it_cannot_read_routes_by_the_model_alone():
    for payload in ({}, {"messages": []}, {"messages": ["not a message"]}, {"messages": [{"role": "user"}]},
                    {"prompt": [1, 2, 3]}, {"prompt": ""}, {"messages": [{"role": "user", "content": 7}]}):
        assert prompt_prefix_key(payload) is None
