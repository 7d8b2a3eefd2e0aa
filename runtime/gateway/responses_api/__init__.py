"""OpenAI's Responses API (`POST /v1/responses`) over the gateway's chat path.

A Responses request is checked here (protocol.py), turned into the chat completion request it means (its
instructions, the stored conversation of `previous_response_id`, its input items as chat messages, its text
format and function tools as the chat path's structured output), generated as any chat request is (routing,
admission, replicas: runtime.gateway.handler), and answered as a Response object or its stream of typed
events (render.py). Finished responses are kept per tenant, bounded and with an expiry (store.py), so the
next turn can name one with `previous_response_id`; `GET` and `DELETE /v1/responses/{id}` read and drop them.
"""
