// Package message is a minimal stub of github.com/ThreeDotsLabs/watermill/message
// with only the shapes the idemkey analyzer looks at.
package message

type Message struct {
	UUID     string
	Payload  []byte
	Metadata map[string]string
}

type HandlerFunc func(msg *Message) ([]*Message, error)

type NoPublishHandlerFunc func(msg *Message) error

type HandlerMiddleware func(h HandlerFunc) HandlerFunc

type Subscriber interface{}

type Publisher interface{}

type Handler struct{}

type Router struct{}

func (r *Router) AddHandler(handlerName, subscribeTopic string, subscriber Subscriber, publishTopic string, publisher Publisher, handlerFunc HandlerFunc) *Handler {
	return &Handler{}
}

func (r *Router) AddNoPublisherHandler(handlerName, subscribeTopic string, subscriber Subscriber, handlerFunc NoPublishHandlerFunc) *Handler {
	return &Handler{}
}

func (r *Router) AddConsumerHandler(handlerName, subscribeTopic string, subscriber Subscriber, handlerFunc NoPublishHandlerFunc) *Handler {
	return &Handler{}
}

func (r *Router) AddMiddleware(m ...HandlerMiddleware) {}
