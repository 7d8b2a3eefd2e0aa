"""Triton Python-backend model `llm_infer`: request/response access to the `llm` model.

Triton's HTTP /infer endpoint (and tritonclient.http) refuses decoupled models, so this
adapter forwards each request's inputs to `llm` with Business Logic Scripting, reads its
(non-streamed) single response, and returns it. Errors from `llm` are passed through.
"""

from __future__ import annotations

import json

import triton_python_backend_utils as pb_utils

from engine_format.requests import OUTPUT_NAMES
from engine_format.serving import MODEL_NAME


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.inputs = [i["name"] for i in config["input"]]

    def execute(self, requests):
        return [self._forward(request) for request in requests]

    def _forward(self, request):
        tensors = [t for t in (pb_utils.get_input_tensor_by_name(request, n) for n in self.inputs) if t is not None]
        forwarded = pb_utils.InferenceRequest(
            model_name=MODEL_NAME, inputs=tensors, requested_output_names=OUTPUT_NAMES, request_id=request.request_id()
        )
        for response in forwarded.exec(decoupled=True):
            if response.has_error():
                return pb_utils.InferenceResponse(error=pb_utils.TritonError(response.error().message()))
            if response.output_tensors():
                return pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.get_output_tensor_by_name(response, name) for name in OUTPUT_NAMES]
                )
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{MODEL_NAME} returned no response"))
