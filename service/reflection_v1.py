"""gRPC server reflection under both names: `grpc.reflection.v1` and `grpc.reflection.v1alpha`.

Current grpcurl, Postman and grpcui ask for `grpc.reflection.v1.ServerReflection`
first; grpcio-reflection ships only the v1alpha service. The two protos are the same
messages with the same field numbers under another package (upstream renamed the
package when it left alpha), so the v1alpha servicer (grpcio-reflection's public
`reflection.aio.ReflectionServicer`) answers v1 calls byte for byte. The v1 file
descriptor is registered in the default pool as well, so that v1 can describe
itself (`grpcurl describe grpc.reflection.v1.ServerReflection`).
"""

from __future__ import annotations

from typing import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

V1_PACKAGE = "grpc.reflection.v1"
V1_FILE = "grpc/reflection/v1/reflection.proto"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME
METHOD = "ServerReflectionInfo"


def _v1_file() -> descriptor_pb2.FileDescriptorProto:
    """v1alpha's file descriptor, renamed to v1's package and file."""
    alpha = v1alpha_pb2.DESCRIPTOR.package
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    prefix = f".{alpha}."
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(prefix):
                field.type_name = f".{V1_PACKAGE}." + field.type_name[len(prefix):]
    for service in proto.service:
        for method in service.method:
            method.input_type = f".{V1_PACKAGE}." + method.input_type[len(prefix):]
            method.output_type = f".{V1_PACKAGE}." + method.output_type[len(prefix):]
    return proto


def register_v1_descriptor(pool: descriptor_pool.DescriptorPool | None = None):
    """Add the v1 file to `pool` (the default one) unless it is there; its file descriptor."""
    pool = pool or descriptor_pool.Default()
    try:
        return pool.FindFileByName(V1_FILE)
    except KeyError:
        pool.AddSerializedFile(_v1_file().SerializeToString())
        return pool.FindFileByName(V1_FILE)


def v1_message(name: str):
    """The v1 message class `name` (ServerReflectionRequest, ...), for clients and tests."""
    register_v1_descriptor()
    return message_factory.GetMessageClass(descriptor_pool.Default().FindMessageTypeByName(f"{V1_PACKAGE}.{name}"))


def enable(service_names: Iterable[str], server: grpc.aio.Server) -> tuple[str, ...]:
    """Reflection on `server` for `service_names` and both reflection services; the names listed."""
    register_v1_descriptor()
    names = tuple(service_names) + (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    reflection.enable_server_reflection(names, server)             # v1alpha
    servicer = reflection.aio.ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
        response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {METHOD: handler}),))
    return names
